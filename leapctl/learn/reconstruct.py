"""Weight reconstruction under a fixed mask: after the hard mask, refit each layer's kept weights by least
squares on calibration activations, so that the sparse layer reproduces what the dense weights computed.

For one output row w (dense) and its kept set S, with H = X^T X / n over the layer's calibration inputs X,
the kept weights v_S minimise (w - v)^T H (w - v) with v zero outside S:

    H_SS v_S = H_S: w                      (exact, one small Cholesky solve per row)

This is the optimum SparseGPT's column-by-column OBS update approximates (it never revisits a column), here
for a mask chosen beforehand (LEAP's). H gets SparseGPT's dampening, 1% of its mean diagonal, and dead
input channels get H_jj = 1 (`leapctl.prune.hessian`, shared with SparseGPT and GPTQ). `RefitPruner` is a
layer pruner like SparseGPT's and GPTQ's: `prune.sequential` drives it block by block on the inputs that
the already-refit blocks produce, so later layers also absorb the error of earlier ones."""

import torch
from torch import nn

from leapctl.masks import MaskSet
from leapctl.prune.hessian import PERCENT_DAMP, dampened
from leapctl.prune.sequential import update_under_masks
from leapctl.prune.sparsegpt import SparseGPTPruner

SOLVE_BYTES = 256 << 20  # rows are solved in batches whose padded H_SS blocks stay under this size


@torch.no_grad()
def refit_rows(weight: torch.Tensor, keep: torch.Tensor, hessian: torch.Tensor,
               percdamp: float = PERCENT_DAMP, cross: torch.Tensor | None = None) -> torch.Tensor:
    """The least-squares kept weights of every row of `weight` [out, in] under `keep` (True = kept), given
    H = X^T X / n [in, in]; pruned entries are exactly 0. With `cross` = X^T X_d / n the target is
    X_d w (another input to the dense weight) instead of X w. Computed in float64 (small, exact solves)."""
    H, _ = dampened(hessian.double(), percdamp)
    W = weight.double()
    keep = keep.to(W.device).bool()
    # row r of the right-hand side: (H w_r)^T (H symmetric; the dampening keeps w where data is scarce),
    # or (C w_r + damp * w_r)^T against the dense inputs
    if cross is None:
        target = W @ H
    else:
        target = W @ cross.double().T + (H.diagonal() - torch.diag(hessian.double())).unsqueeze(0) * W
    out = torch.zeros_like(W)
    counts = keep.sum(dim=1)
    order = torch.argsort(counts)  # rows with similar counts share a batch: little padding
    widest = max(int(counts.max()), 1)
    batch = max(1, SOLVE_BYTES // (8 * widest * widest))
    for start in range(0, W.shape[0], batch):
        chosen = order[start:start + batch]
        width = int(counts[chosen[-1]])  # rows are sorted by count: the batch's widest row is its last
        if width == 0:
            continue
        # kept column indices of each row, left-aligned and padded with column 0
        ranks = torch.cumsum(keep[chosen].long(), dim=1) - 1
        index = torch.zeros(len(chosen), width, dtype=torch.long, device=W.device)
        valid = torch.zeros(len(chosen), width, dtype=torch.bool, device=W.device)
        r, c = keep[chosen].nonzero(as_tuple=True)
        index[r, ranks[r, c]] = c
        valid[r, ranks[r, c]] = True
        A = H[index.unsqueeze(2), index.unsqueeze(1)]  # [batch, width, width]
        pair = valid.unsqueeze(2) & valid.unsqueeze(1)
        A = torch.where(pair, A, torch.zeros((), dtype=A.dtype, device=A.device))
        A.diagonal(dim1=1, dim2=2).add_((~valid).to(A.dtype))  # padding: identity, right-hand side 0
        b = torch.gather(target[chosen], 1, index) * valid
        factor, info = torch.linalg.cholesky_ex(A)
        if bool((info != 0).any()):  # not positive definite in float64 even with dampening: least squares
            solution = torch.linalg.lstsq(A, b.unsqueeze(2)).solution.squeeze(2)
        else:
            solution = torch.cholesky_solve(b.unsqueeze(2), factor).squeeze(2)
        block = torch.zeros(len(chosen), W.shape[1], dtype=W.dtype, device=W.device)
        block.scatter_add_(1, index, solution * valid)  # padding adds 0 to column 0
        out[chosen] = block
    return out * keep


class RefitPruner(SparseGPTPruner):
    """Accumulates X^T X for one masked linear layer (SparseGPT's statistics, inherited), then replaces its
    kept weights by their least-squares refit under the fixed mask (`refit_rows`)."""

    def __init__(self, linear: nn.Linear, mask: torch.Tensor, percdamp: float = PERCENT_DAMP):
        super().__init__(linear, percdamp=percdamp)
        self.mask = mask

    @torch.no_grad()
    def prune(self, sparsity: float) -> torch.Tensor:
        """Refit in place and return the (unchanged) keep-mask; `sparsity` is the mask's own."""
        refit = refit_rows(self.linear.weight, self.mask, self.take_hessian(), self.percdamp)
        self.linear.weight.copy_(refit.to(self.linear.weight.dtype))
        return self.mask.cpu()


@torch.no_grad()
def reconstruct_weights(model: nn.Module, mask_set: MaskSet, calib_ids: torch.Tensor,
                        device: str | torch.device | None = None, batch_size: int = 8,
                        percdamp: float = PERCENT_DAMP, progress: bool = True) -> MaskSet:
    """Replace the weights of every masked linear of `model` (dense on entry) by their least-squares refit
    under the mask, in place, block by block on the calibration windows `calib_ids` [n, seq_len]. The
    target is what the dense weight computes on the layer's inputs in the sparse model (SparseGPT's
    objective)."""
    update_under_masks(model, calib_ids, mask_set,
                       lambda linear, mask, name: RefitPruner(linear, mask, percdamp), "reconstruct",
                       device=device, batch_size=batch_size, progress=progress)
    return mask_set
