"""How many weights a comparison group loses, and which: shared by every one-shot method so that
the achieved sparsity is exact and the same rounding rule holds everywhere."""

import math

import torch


def prune_count(group_size: int, sparsity: float) -> int:
    """Weights pruned in a group of `group_size`: floor(group_size * sparsity), as the reference code's
    `int(n * sparsity)`; the tiny epsilon keeps e.g. 0.7 * 10 from flooring to 6."""
    return math.floor(group_size * sparsity + 1e-9)


def keep_mask_per_row(scores: torch.Tensor, n_pruned: int) -> torch.Tensor:
    """Boolean keep-mask that drops the `n_pruned` lowest scores of every row (stable sort, so ties go
    to the lower column index, as in the Wanda reference)."""
    keep = torch.ones_like(scores, dtype=torch.bool)
    if n_pruned > 0:
        lowest = torch.sort(scores, dim=1, stable=True).indices[:, :n_pruned]
        keep.scatter_(1, lowest, False)
    return keep
