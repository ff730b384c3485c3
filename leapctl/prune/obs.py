"""The column-by-column error feedback (Optimal Brain Surgeon updates) that SparseGPT and GPTQ share: each
column of a layer's weight is replaced by its target (0 where pruned, a grid level where quantized) and the
error spread over the later columns through the upper Cholesky factor U of the inverse Hessian, within a
block at once and over the later blocks lazily, once per block, as SparseGPT's and GPTQ's reference code
do. The methods differ only in each column's target, so that is all they pass in."""

from collections.abc import Callable

import torch

from leapctl.prune.hessian import PERCENT_DAMP, dampened

# target(block, start, i) -> column i of the block starting at column `start`, on its target; `block` is the
# block's working copy with every earlier column's error already spread into it (read it, never write it).
Target = Callable[[torch.Tensor, int, int], torch.Tensor]


def inverse_hessian_factor(hessian: torch.Tensor,
                           percdamp: float = PERCENT_DAMP) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, dead): U upper-triangular with U^T U = (H + damp I)^-1 after dead channels get H_jj = 1."""
    H, dead = dampened(hessian, percdamp)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True), dead


def feed_errors_forward(W: torch.Tensor, U: torch.Tensor, blocksize: int, target: Target) -> None:
    """Put every column of W on `target`'s value, left to right, in place, each column's error compensated
    by the columns after it (W and U in the same column order)."""
    cols = W.shape[1]
    for start in range(0, cols, blocksize):
        end = min(start + blocksize, cols)
        W1, U1 = W[:, start:end].clone(), U[start:end, start:end]
        Q1, Err1 = torch.zeros_like(W1), torch.zeros_like(W1)
        for i in range(end - start):
            w = W1[:, i]
            q = target(W1, start, i)
            Q1[:, i] = q
            err = (w - q) / U1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * U1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, start:end] = Q1
        W[:, end:] -= Err1 @ U[start:end, end:]
