"""LEAP: learnable end-to-end adaptive pruning. `leap_masks(model, tokenizer, corpus, LearnConfig(...))`
learns a mask in memory; `learn_masks(LearnConfig(...))` is `leapctl learn` (load, learn, write the run)."""

from leapctl.learn.config import LearnConfig
from leapctl.learn.train import LearnedMasks, LearnInterrupted, LearnResult, leap_masks, learn_masks

__all__ = ["LearnConfig", "LearnResult", "LearnedMasks", "LearnInterrupted", "leap_masks", "learn_masks"]
