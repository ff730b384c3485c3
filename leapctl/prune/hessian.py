"""The one Hessian helper of the layer-wise methods (SparseGPT, GPTQ, the least-squares refit): H = X^T X
over a layer's calibration inputs, dead input channels (H_jj = 0) given H_jj = 1, and dampening of
`percdamp` times the mean diagonal added to the diagonal, as SparseGPT's reference does."""

import torch

PERCENT_DAMP = 0.01


def dampened(hessian: torch.Tensor, percdamp: float = PERCENT_DAMP) -> tuple[torch.Tensor, torch.Tensor]:
    """(H with dead channels set to 1 and the dampening added, a copy in H's dtype; the dead channels)."""
    H = hessian.clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    H.diagonal().add_(percdamp * torch.mean(torch.diag(H)))
    return H, dead
