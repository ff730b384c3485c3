"""GPTQ restricted to the kept weights: quantize a pruned layer column by column with the mask fixed, and
spread each column's error over the later columns with the inverse Hessian, as SparseGPT's joint
sparsify-and-quantize does (its reference code quantizes the kept weights inside the same OBS update).

A pruned weight's target is 0, a kept weight's its nearest grid level; the OBS step compensates both. A
group's scale is searched (`rtn.search_scales`) on the group's kept weights as they stand when the
group's first column is reached, so it sees the error already pushed into it by earlier groups. The
Hessian is the one SparseGPT uses (`prune.sparsegpt.inverse_hessian_factor`)."""

import torch
from torch import nn

from leapctl.prune.sparsegpt import PERCENT_DAMP, SparseGPTPruner, inverse_hessian_factor
from leapctl.quantize.rtn import round_to_grid, search_scales

BLOCK_SIZE = 128


def gptq_quantize(weight: torch.Tensor, mask: torch.Tensor, hessian: torch.Tensor, group_size: int,
                  percdamp: float = PERCENT_DAMP) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weight, kept entries on the grid and pruned ones +0.0; fp16 scales [rows, cols/group])."""
    W = weight.detach().to(hessian.dtype).clone()
    rows, cols = W.shape
    keep = mask.to(W.device)
    U, dead = inverse_hessian_factor(hessian, percdamp)
    W[:, dead] = 0
    scales = torch.zeros(rows, cols // group_size, dtype=torch.float16, device=W.device)
    blocksize = group_size * -(-BLOCK_SIZE // group_size)  # whole groups per block
    for start in range(0, cols, blocksize):
        end = min(start + blocksize, cols)
        W1, U1 = W[:, start:end].clone(), U[start:end, start:end]
        Q1, Err1 = torch.zeros_like(W1), torch.zeros_like(W1)
        for i in range(end - start):
            column = start + i
            if column % group_size == 0:
                group = column // group_size
                span = slice(i, i + group_size)
                scales[:, group] = search_scales(W1[:, span], keep[:, column:column + group_size],
                                                 group_size)[:, 0]
            w = W1[:, i]
            rounded = round_to_grid(w.unsqueeze(1), scales[:, column // group_size].unsqueeze(1))[:, 0]
            q = torch.where(keep[:, column], rounded, torch.zeros_like(w))
            Q1[:, i] = q
            err = (w - q) / U1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * U1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, start:end] = Q1
        W[:, end:] -= Err1 @ U[start:end, end:]
    return W.float(), scales


class GPTQQuantizer(SparseGPTPruner):
    """Accumulates X^T X for one masked linear layer (SparseGPT's statistics, inherited), then quantizes its
    kept weights with the mask fixed; `sequential.prune_sequentially` drives it block by block."""

    def __init__(self, linear: nn.Linear, mask: torch.Tensor, group_size: int, scales_out: dict, name: str):
        super().__init__(linear)
        self.mask, self.group_size = mask, group_size
        self.scales_out, self.name = scales_out, name

    @torch.no_grad()
    def prune(self, sparsity: float) -> torch.Tensor:
        """Quantize in place and return the (unchanged) keep-mask; `sparsity` is the mask's own."""
        weight, scales = gptq_quantize(self.linear.weight, self.mask, self.take_hessian(), self.group_size,
                                       self.percdamp)
        self.linear.weight.copy_(weight.to(self.linear.weight.dtype))
        self.scales_out[self.name] = scales.cpu()
        return self.mask.cpu()
