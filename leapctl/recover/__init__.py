"""Recovery of the kept weights after the mask is fixed: distillation from the dense model, mask held
(`train.py`), and the settings of `leapctl recover` (`config.py`)."""

from leapctl.recover.config import RecoverConfig
from leapctl.recover.train import (
    RecoverInterrupted,
    RecoveryResult,
    RecoverySettings,
    distillation_losses,
    recover_weights,
    step_batch,
)

__all__ = ["RecoverConfig", "RecoverInterrupted", "RecoveryResult", "RecoverySettings", "distillation_losses",
           "recover_weights", "step_batch"]
