"""One-shot pruning: magnitude, Wanda and SparseGPT, with `prune_model` as the single entry point."""

import torch
from torch import nn

from leapctl.errors import LeapctlError
from leapctl.masks import MaskSet
from leapctl.prune.magnitude import magnitude_masks
from leapctl.prune.sparsegpt import sparsegpt_masks
from leapctl.prune.wanda import wanda_masks

METHODS = ("magnitude", "wanda", "sparsegpt")
CALIBRATED = ("wanda", "sparsegpt")


def check_method(method: str) -> None:
    if method not in METHODS:
        raise LeapctlError(f"unknown pruning method {method!r} (choose from {', '.join(METHODS)})")


def check_sparsity(sparsity: float) -> None:
    if not 0.0 < sparsity < 1.0:
        raise LeapctlError(f"sparsity must lie strictly between 0 and 1, got {sparsity}")


def prune_model(model: nn.Module, method: str, sparsity: float, calib_ids: torch.Tensor | None = None,
                include: str | None = None, exclude: str | None = None,
                device: str | torch.device | None = None, batch_size: int = 8,
                progress: bool = True) -> MaskSet:
    """Prune the model in place (zeros, and SparseGPT's updated weights) and return the keep-masks.

    `calib_ids` [nsamples, seq_len] token ids are needed by Wanda and SparseGPT, ignored by magnitude."""
    check_method(method)
    check_sparsity(sparsity)
    if method == "magnitude":
        return magnitude_masks(model, sparsity, include, exclude)
    if calib_ids is None:
        raise LeapctlError(f"{method} needs calibration data")
    options = dict(include=include, exclude=exclude, device=device, batch_size=batch_size, progress=progress)
    if method == "wanda":
        return wanda_masks(model, calib_ids, sparsity, **options)
    return sparsegpt_masks(model, calib_ids, sparsity, **options)
