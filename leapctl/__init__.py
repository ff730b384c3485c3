"""leapctl: learnable end-to-end adaptive pruning (LEAP) for LLMs, sparse export and sparse serving."""

__version__ = "0.1.0"
