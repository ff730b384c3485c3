"""LEAP: learnable end-to-end adaptive pruning. `learn_masks(LearnConfig(...))` runs it."""

from leapctl.learn.config import LearnConfig
from leapctl.learn.train import LearnResult, learn_masks

__all__ = ["LearnConfig", "LearnResult", "learn_masks"]
