"""Wanda (Sun et al., 2023): score |W_ij| * ||X_j||, prune the lowest-scoring weights of each output row.

||X_j|| is the root mean square of input channel j over all calibration tokens (the reference uses the
squared L2 norm divided by the sample count; a common factor per layer does not change any row's order).
Each row loses exactly floor(in_features * sparsity) weights."""

import torch
from torch import nn

from leapctl.masks import MaskSet, masked_weight
from leapctl.models import ModelLayout
from leapctl.prune.select import keep_mask_per_row, prune_count
from leapctl.prune.sequential import prune_sequentially


def wanda_keep_mask(weight: torch.Tensor, input_sq_mean: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Keep-mask from the weight [out, in] and the mean of x_j^2 per input channel [in]."""
    scores = weight.detach().float().abs() * input_sq_mean.float().sqrt().unsqueeze(0)
    return keep_mask_per_row(scores, prune_count(weight.shape[1], sparsity))


class WandaPruner:
    """Accumulates sum x_j^2 over tokens for one linear layer, then zeros its lowest-scoring weights."""

    def __init__(self, linear: nn.Linear):
        self.linear = linear
        self.sq_sum = torch.zeros(linear.in_features, dtype=torch.float32, device=linear.weight.device)
        self.tokens = 0

    def add_batch(self, inputs: torch.Tensor) -> None:
        x = inputs.detach().reshape(-1, self.linear.in_features).float()
        self.sq_sum += x.pow(2).sum(dim=0)
        self.tokens += x.shape[0]

    @torch.no_grad()
    def prune(self, sparsity: float) -> torch.Tensor:
        keep = wanda_keep_mask(self.linear.weight, self.sq_sum / max(self.tokens, 1), sparsity)
        self.linear.weight.copy_(masked_weight(self.linear.weight, keep))
        return keep


def wanda_masks(model: nn.Module, calib_ids: torch.Tensor, sparsity: float, include: str | None = None,
                exclude: str | None = None, device: str | torch.device | None = None, batch_size: int = 8,
                in_place: bool = True, progress: bool = True, layout: ModelLayout | None = None) -> MaskSet:
    """Sequential Wanda masks for every prunable linear; `in_place=False` leaves the weights dense
    (the LEAP initialiser needs the masks, not the zeros)."""
    return prune_sequentially(model, calib_ids, WandaPruner, sparsity, "wanda", include=include,
                              exclude=exclude, device=device, batch_size=batch_size, in_place=in_place,
                              progress=progress, layout=layout)
