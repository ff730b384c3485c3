"""SparseGPT (Frantar & Alistarh, 2023): prune and reconstruct each layer with approximate OBS updates.

Faithful to the reference `fasterprune`: H = 2/n sum x x^T in fp32 (n = calibration tokens here; the
reference divides by sequences, a common factor that changes neither mask nor update); dead input
channels get H_jj = 1 and their weight column zeroed; dampening 0.01 * mean(diag H); U = upper Cholesky
factor of H^-1; in 128-column blocks, the mask is chosen over the whole block (all rows together) by
w^2 / U_jj^2, then columns are pruned one by one with the OBS error spread over the block's remaining
columns and, lazily, over the later columns once per block (`obs.feed_errors_forward`, GPTQ's loop too).
Each block loses exactly floor(rows * block_columns * sparsity) weights (the reference cuts at a threshold,
`<=`, one more)."""

import torch
from torch import nn

from leapctl.masks import MaskSet, masked_weight
from leapctl.prune.hessian import PERCENT_DAMP
from leapctl.prune.obs import feed_errors_forward, inverse_hessian_factor
from leapctl.prune.select import keep_mask_per_row, prune_count
from leapctl.prune.sequential import prune_sequentially

BLOCK_SIZE = 128


def sparsegpt_prune_weight(weight: torch.Tensor, hessian: torch.Tensor, sparsity: float,
                           blocksize: int = BLOCK_SIZE,
                           percdamp: float = PERCENT_DAMP) -> tuple[torch.Tensor, torch.Tensor]:
    """(pruned and updated weight, keep-mask), computed in the Hessian's dtype."""
    W = weight.detach().to(hessian.dtype).clone()
    U, dead = inverse_hessian_factor(hessian, percdamp)
    W[:, dead] = 0
    keep = torch.ones(W.shape, dtype=torch.bool, device=W.device)

    def target(block: torch.Tensor, start: int, i: int) -> torch.Tensor:
        end = start + block.shape[1]
        if i == 0:  # the block's mask, over all its rows at once, before any of its columns moves
            scores = block.pow(2) / torch.diag(U[start:end, start:end]).pow(2).unsqueeze(0)
            n_pruned = prune_count(scores.numel(), sparsity)
            keep[:, start:end] = keep_mask_per_row(scores.reshape(1, -1), n_pruned).reshape(scores.shape)
        w = block[:, i]
        return torch.where(keep[:, start + i], w, torch.zeros_like(w))

    feed_errors_forward(W, U, blocksize, target)
    return W, keep


class SparseGPTPruner:
    """Accumulates X^T X for one linear layer, then prunes and reconstructs its weight."""

    def __init__(self, linear: nn.Linear, blocksize: int = BLOCK_SIZE, percdamp: float = PERCENT_DAMP):
        self.linear = linear
        self.blocksize = blocksize
        self.percdamp = percdamp
        n = linear.in_features
        self.xtx = torch.zeros(n, n, dtype=torch.float32, device=linear.weight.device)
        self.tokens = 0

    def add_batch(self, inputs: torch.Tensor) -> None:
        x = inputs.detach().reshape(-1, self.linear.in_features).float()
        self.xtx.addmm_(x.T, x)
        self.tokens += x.shape[0]

    def take_hessian(self) -> torch.Tensor:
        """H = 2/n X^T X (n calibration tokens); the statistics are freed before the caller allocates."""
        hessian = self.xtx * (2.0 / max(self.tokens, 1))
        self.xtx = None
        return hessian

    @torch.no_grad()
    def prune(self, sparsity: float) -> torch.Tensor:
        weight, keep = sparsegpt_prune_weight(self.linear.weight, self.take_hessian(), sparsity,
                                              self.blocksize, self.percdamp)
        self.linear.weight.copy_(masked_weight(weight.to(self.linear.weight.dtype), keep))
        return keep


def sparsegpt_masks(model: nn.Module, calib_ids: torch.Tensor, sparsity: float, include: str | None = None,
                    exclude: str | None = None, device: str | torch.device | None = None, batch_size: int = 8,
                    blocksize: int = BLOCK_SIZE, percdamp: float = PERCENT_DAMP,
                    progress: bool = True) -> MaskSet:
    """Sequential SparseGPT: prunes and updates the model's weights in place and returns the masks."""
    return prune_sequentially(model, calib_ids, lambda linear: SparseGPTPruner(linear, blocksize, percdamp),
                              sparsity, "sparsegpt", include=include, exclude=exclude, device=device,
                              batch_size=batch_size, progress=progress)
