"""GPTQ restricted to the kept weights: quantize a pruned layer column by column with the mask fixed, and
spread each column's error over the later columns with the inverse Hessian, as SparseGPT's joint
sparsify-and-quantize does (its reference code quantizes the kept weights inside the same OBS update).

A pruned weight's target is 0, a kept weight's its nearest grid level; the OBS step compensates both. The
Hessian and the column loop are SparseGPT's (`prune.obs`: `inverse_hessian_factor`, `feed_errors_forward`).

Two column orders:
- act order (the default): columns in decreasing order of the Hessian's diagonal (the inputs with the most
  energy first, while the most later columns remain to absorb their error), with static groups: every group's
  scale (and zero point, on the asymmetric grid) searched (`grid.GRIDS`) up front on its kept weights as they
  are, since a group's columns no longer come together. Measured on SmolLM2 (a LEAP 50% run, asymmetric grid,
  no tuning; bench/results/README.md): held-apart perplexity +6.6% over the 16-bit values against +14.3% in
  the natural order.
- natural order: left to right, a group's grid searched when its first column is reached, so it sees the
  error already pushed into it by earlier groups."""

import torch
from torch import nn

from leapctl.grid import GRIDS, SYMMETRIC, round_to_grid
from leapctl.prune.hessian import PERCENT_DAMP
from leapctl.prune.obs import feed_errors_forward, inverse_hessian_factor
from leapctl.prune.sparsegpt import SparseGPTPruner

BLOCK_SIZE = 128


def gptq_quantize(weight: torch.Tensor, mask: torch.Tensor, hessian: torch.Tensor, group_size: int,
                  percdamp: float = PERCENT_DAMP, grid: str = SYMMETRIC,
                  act_order: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(fp32 weight, kept entries on the grid and pruned ones +0.0; fp16 scales [rows, cols/group]; uint8
    zero points of the same shape on the asymmetric grid, else None)."""
    W = weight.detach().to(hessian.dtype).clone()
    rows, cols = W.shape
    keep = mask.to(W.device)
    search = GRIDS[grid]
    scales = torch.zeros(rows, cols // group_size, dtype=torch.float16, device=W.device)
    zeros = None if grid == SYMMETRIC else torch.zeros(scales.shape, dtype=torch.uint8, device=W.device)

    def set_grid(group: int, w: torch.Tensor) -> None:
        found, zero = search(w, keep[:, group * group_size:(group + 1) * group_size], group_size)
        scales[:, group] = found[:, 0]
        if zeros is not None:
            zeros[:, group] = zero[:, 0]

    order = torch.arange(cols, device=W.device)
    if act_order:
        W[:, torch.diag(hessian) == 0] = 0  # dead inputs, as inverse_hessian_factor finds them
        for group in range(cols // group_size):
            set_grid(group, W[:, group * group_size:(group + 1) * group_size])
        order = torch.argsort(torch.diag(hessian), descending=True, stable=True)
        hessian = hessian[order][:, order]
    U, dead = inverse_hessian_factor(hessian, percdamp)
    W, keep_ordered = W[:, order], keep[:, order]
    W[:, dead] = 0
    blocksize = group_size * -(-BLOCK_SIZE // group_size)  # whole groups per block in the natural order

    def target(block: torch.Tensor, start: int, i: int) -> torch.Tensor:
        group = int(order[start + i]) // group_size
        if not act_order and (start + i) % group_size == 0:
            set_grid(group, block[:, i:i + group_size])
        w = block[:, i]
        rounded = round_to_grid(w.unsqueeze(1), scales[:, group].unsqueeze(1),
                                None if zeros is None else zeros[:, group].unsqueeze(1))[:, 0]
        return torch.where(keep_ordered[:, start + i], rounded, torch.zeros_like(w))

    feed_errors_forward(W, U, blocksize, target)
    return W[:, torch.argsort(order)].float(), scales, zeros


class GPTQQuantizer(SparseGPTPruner):
    """Accumulates X^T X for one masked linear layer (SparseGPT's statistics, inherited), then quantizes its
    kept weights with the mask fixed; `sequential.prune_sequentially` drives it block by block."""

    def __init__(self, linear: nn.Linear, mask: torch.Tensor, group_size: int, scales_out: dict, name: str,
                 grid: str = SYMMETRIC, zeros_out: dict | None = None, act_order: bool = True):
        super().__init__(linear)
        self.mask, self.group_size, self.grid, self.act_order = mask, group_size, grid, act_order
        self.scales_out, self.zeros_out, self.name = scales_out, zeros_out, name

    @torch.no_grad()
    def prune(self, sparsity: float) -> torch.Tensor:
        """Quantize in place and return the (unchanged) keep-mask; `sparsity` is the mask's own."""
        weight, scales, zeros = gptq_quantize(self.linear.weight, self.mask, self.take_hessian(),
                                              self.group_size, self.percdamp, self.grid,
                                              self.act_order)
        self.linear.weight.copy_(weight.to(self.linear.weight.dtype))
        self.scales_out[self.name] = scales.cpu()
        if zeros is not None and self.zeros_out is not None:
            self.zeros_out[self.name] = zeros.cpu()
        return self.mask.cpu()
