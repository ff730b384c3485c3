"""Weight reconstruction under a fixed mask: after the hard mask, refit each layer's kept weights by least
squares on calibration activations, so that the sparse layer reproduces what the dense weights computed.

For one output row w (dense) and its kept set S, with H = X^T X / n over the layer's calibration inputs X,
the kept weights v_S minimise (w - v)^T H (w - v) with v zero outside S:

    H_SS v_S = H_S: w                      (exact, one small Cholesky solve per row)

This is the optimum SparseGPT's column-by-column OBS update approximates (it never revisits a column), here
for a mask chosen beforehand (LEAP's). H gets SparseGPT's dampening, 1% of its mean diagonal, and dead
input channels get H_jj = 1. Layers are refit block by block on the inputs that the already-refit blocks
produce (`leapctl.prune.sequential`), so later layers also absorb the error of earlier ones."""

import copy

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from leapctl.compute import resolve_device
from leapctl.masks import MaskSet
from leapctl.models import model_layout
from leapctl.prune.sequential import _block_output, _device_of, capture_block_inputs

PERCENT_DAMP = 0.01
SOLVE_BYTES = 256 << 20  # rows are solved in batches whose padded H_SS blocks stay under this size


@torch.no_grad()
def refit_rows(weight: torch.Tensor, keep: torch.Tensor, hessian: torch.Tensor,
               percdamp: float = PERCENT_DAMP, cross: torch.Tensor | None = None) -> torch.Tensor:
    """The least-squares kept weights of every row of `weight` [out, in] under `keep` (True = kept), given
    H = X^T X / n [in, in]; pruned entries are exactly 0. With `cross` = X^T X_d / n the target is
    X_d w (another input to the dense weight) instead of X w. Computed in float64 (small, exact solves)."""
    H = hessian.double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    H.diagonal().add_(percdamp * torch.mean(torch.diag(H)))
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


class _Statistics:
    """X_s^T X_s and X_s^T X_d of one linear layer, summed over calibration tokens: X_s its inputs in the
    sparse model, X_d (with `dense_target`) the same layer's inputs in the dense model."""

    def __init__(self, features: int, device: torch.device, dense_target: bool):
        self.xtx = torch.zeros(features, features, dtype=torch.float32, device=device)
        self.cross = torch.zeros_like(self.xtx) if dense_target else None
        self.tokens = 0

    def add(self, sparse_x: torch.Tensor, dense_x: torch.Tensor | None) -> None:
        x = sparse_x.detach().reshape(-1, self.xtx.shape[0]).float()
        self.xtx.addmm_(x.T, x)
        if self.cross is not None:
            self.cross.addmm_(x.T, dense_x.detach().reshape(-1, self.xtx.shape[0]).float())
        self.tokens += x.shape[0]


@torch.no_grad()
def reconstruct_weights(model: nn.Module, mask_set: MaskSet, calib_ids: torch.Tensor,
                        device: str | torch.device | None = None, batch_size: int = 8,
                        dense_target: bool = False, percdamp: float = PERCENT_DAMP,
                        progress: bool = True) -> MaskSet:
    """Replace the weights of every masked linear of `model` (dense on entry) by their least-squares refit
    under the mask, in place, block by block on the calibration windows `calib_ids` [n, seq_len].

    The target is what the dense weight computes on the layer's inputs in the sparse model (SparseGPT's
    objective) or, with `dense_target`, what the dense model computes on its own inputs (so each layer also
    corrects the error the sparse layers before it made)."""
    compute = resolve_device(device)
    layout = model_layout(model)
    blocks, prefix = layout.blocks, layout.prefix
    masks = {name.removesuffix(".weight"): keep for name, keep in mask_set.masks.items()}
    hidden, block_args = capture_block_inputs(model, layout, calib_ids, compute, batch_size)
    dense_hidden = hidden.clone() if dense_target else None
    parts = [slice(i * batch_size, (i + 1) * batch_size) for i in range(len(block_args[0]))]
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=Console(stderr=True), disable=not progress) as bar:
        task = bar.add_task("reconstruct: decoder blocks", total=len(blocks))
        for index, block in enumerate(blocks):
            home = _device_of(block)
            block.to(compute)
            mine = {name: module for name, module in block.named_modules()
                    if f"{prefix}.{index}.{name}" in masks}
            dense_block = copy.deepcopy(block) if dense_target else None
            stats = {name: _Statistics(module.in_features, compute, dense_target)
                     for name, module in mine.items()}
            for part, (args, kwargs) in zip(parts, block_args[index], strict=True):
                dense_inputs = (_inputs_of(dense_block, mine, dense_hidden[part], args, kwargs)
                                if dense_target else {})
                sparse_inputs = _inputs_of(block, mine, hidden[part], args, kwargs)
                for name, x in sparse_inputs.items():
                    stats[name].add(x, dense_inputs.get(name))
                del dense_inputs, sparse_inputs
            for name, module in mine.items():
                s = stats.pop(name)
                hessian = s.xtx / max(s.tokens, 1)
                cross = None if s.cross is None else s.cross / max(s.tokens, 1)
                refit = refit_rows(module.weight, masks[f"{prefix}.{index}.{name}"], hessian, percdamp, cross)
                module.weight.copy_(refit.to(module.weight.dtype))
            for part, (args, kwargs) in zip(parts, block_args[index], strict=True):
                hidden[part] = _block_output(block, hidden[part], args, kwargs)
                if dense_target:
                    dense_hidden[part] = _block_output(dense_block, dense_hidden[part], args, kwargs)
            del dense_block
            block.to(home)
            bar.advance(task)
    return mask_set


def _inputs_of(block: nn.Module, linears: dict[str, nn.Linear], hidden: torch.Tensor, args: tuple,
               kwargs: dict) -> dict[str, torch.Tensor]:
    """The inputs each named linear of `block` receives when the block runs on `hidden`."""
    seen: dict[str, torch.Tensor] = {}
    modules = dict(block.named_modules())
    hooks = [modules[name].register_forward_hook(
        lambda _m, inputs, _out, name=name: seen.__setitem__(name, inputs[0])) for name in linears]
    try:
        _block_output(block, hidden, args, kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen
