"""LEAP's regularisers, computed from the scalars each masked layer records in its forward.

    loss = LM loss + lambda1 * |sum_l sum(M_l) / N - rho|
                   - lambda2 * (1 - step / T) * sum_l ||M_l * W_l||_F / sum_l ||W_l||_F

The density term acts on the global mean of the soft mask over all masked weights together, so the
budget can move between layers. The magnitude term is the authors' scale-free form: the paper writes
-lambda2 * sum ||M * W||_1, which unnormalised grows with model size and swamps the LM loss; dividing
by the dense norms makes it a ratio in [0, 1] whatever the model, and the (1 - step / T) factor fades
it out so the end of training is driven by the LM loss and the budget alone.

With distillation (`distill` = d > 0) the LM loss is replaced by (1 - d) * LM loss + d * KL(dense || masked),
the KL against the logits of the same frozen model with the masks off (`leapctl.distill`)."""

from dataclasses import dataclass

import torch


@dataclass
class RegulariserTerms:
    density: torch.Tensor  # global mean of the soft mask
    density_penalty: torch.Tensor  # lambda1 * |density - rho|
    magnitude_penalty: torch.Tensor  # -lambda2 * decay * kept-norm ratio (<= 0)


def regularisers(
    mask_sums: list[torch.Tensor],
    masked_norms_sq: list[torch.Tensor],
    total_weights: int,
    dense_norm_sum: float,
    rho: float,
    lambda1: float,
    lambda2: float,
    magnitude_decay: float,
) -> RegulariserTerms:
    """Both penalty terms from one forward's records (one entry per masked layer)."""
    density = torch.stack(mask_sums).sum() / total_weights
    density_penalty = lambda1 * (density - rho).abs()
    if lambda2 and magnitude_decay:
        kept_norm = torch.stack(masked_norms_sq).clamp_min(1e-30).sqrt().sum()
        magnitude_penalty = -lambda2 * magnitude_decay * kept_norm / dense_norm_sum
    else:
        magnitude_penalty = torch.zeros((), device=density.device)
    return RegulariserTerms(density, density_penalty, magnitude_penalty)
