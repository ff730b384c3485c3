"""`compress`: one call from a dense model to a sparse (and 4-bit) run folder at a budget that fits the
machine: the settings (`config.py`), the budget's plan (`plan.py`), the stages (`pipeline.py`) and the final
table (`report.py`)."""

from leapctl.compress.config import CompressConfig
from leapctl.compress.pipeline import compress

__all__ = ["CompressConfig", "compress"]
