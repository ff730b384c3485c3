"""Magnitude pruning: within each layer, zero the smallest |W|.

The comparison group is the whole layer (one threshold per weight matrix), as in the magnitude baseline
of the Wanda reference code (`prune_magnitude`: sort |W| flattened, cut at int(numel * sparsity)), which
produced the published LLaMA-2-7B figure. Needs no calibration data."""

import torch
from torch import nn

from leapctl.masks import MaskSet, masked_weight
from leapctl.models import prunable_linears
from leapctl.prune.select import keep_mask_per_row, prune_count


def magnitude_keep_mask(weight: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Keep-mask that drops exactly floor(numel * sparsity) weights of smallest magnitude."""
    scores = weight.detach().abs().float().reshape(1, -1)
    return keep_mask_per_row(scores, prune_count(weight.numel(), sparsity)).reshape(weight.shape)


@torch.no_grad()
def magnitude_masks(model: nn.Module, sparsity: float, include: str | None = None,
                    exclude: str | None = None, in_place: bool = True) -> MaskSet:
    """Per-layer magnitude masks for every prunable linear; zeros the pruned weights when `in_place`."""
    masks = {}
    for name, linear in prunable_linears(model, include, exclude).items():
        keep = magnitude_keep_mask(linear.weight, sparsity)
        if in_place:
            linear.weight.copy_(masked_weight(linear.weight, keep))
        masks[f"{name}.weight"] = keep.cpu()
    return MaskSet(masks=masks, model=str(getattr(model, "name_or_path", "")),
                   extra={"method": "magnitude", "target_sparsity": sparsity})
