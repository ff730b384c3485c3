"""LEAP's regularisers, computed from the scalars each masked layer records in its forward.

    loss = LM loss + lambda1 * |sum_l sum(M_l) / N - rho|
                   - lambda2 * (1 - step / T) * sum_l ||M_l * W_l||_F / sum_l ||W_l||_F

The density term acts on the global mean of the soft mask over all masked weights together, so the
budget can move between layers. The magnitude term is the authors' scale-free form: the paper writes
-lambda2 * sum ||M * W||_1, which unnormalised grows with model size and swamps the LM loss; dividing
by the dense norms makes it a ratio in [0, 1] whatever the model, and the (1 - step / T) factor fades
it out so the end of training is driven by the LM loss and the budget alone.

With distillation (`distill` = d > 0) the LM loss is replaced by (1 - d) * LM loss + d * KL(dense || masked),
the KL against the logits of the same frozen model with the masks off."""

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


class _LanguageModelAndDistillation(torch.autograd.Function):
    """Both losses from one log-softmax of the student's logits, and their gradient in one pass:
    d/ds [a * CE + b * KL] = (a + b) * softmax(s) - a * onehot(label) - b * softmax(t), per position.
    Autograd's version (cross-entropy, two log-softmaxes, kl_div, each with its backward) took 4-5 passes
    over the [positions, vocabulary] logits, as long as the rest of a small model's step on a CPU."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor):
        log_p = torch.log_softmax(student.float(), dim=-1)
        log_q = torch.log_softmax(teacher.float(), dim=-1)
        q = log_q.exp()
        nll = -log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        kl = log_q.sub_(log_p).mul_(q).sum(-1)  # in place: one [positions, vocabulary] buffer, not three
        ctx.save_for_backward(log_p, q, labels)
        ctx.student_dtype = student.dtype
        return nll.mean(), kl.mean()

    @staticmethod
    def backward(ctx, grad_lm: torch.Tensor, grad_kl: torch.Tensor):
        log_p, q, labels = ctx.saved_tensors
        positions = log_p.shape[0]
        grad = log_p.exp().mul_(grad_lm + grad_kl).addcmul_(q, -grad_kl)
        grad.scatter_add_(-1, labels.unsqueeze(-1), (-grad_lm).expand(positions, 1).contiguous())
        return grad.div_(positions).to(ctx.student_dtype), None, None


def language_model_and_distillation(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                                    ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(LM loss, KL(teacher || student)), each a mean over the positions the LM loss predicts (every
    position but each sequence's last, labelled by the next token), in float32: the dense model (the same
    frozen weights with the masks off) is the teacher, the masked model the student."""
    vocabulary = student_logits.shape[-1]
    student = student_logits[:, :-1].reshape(-1, vocabulary)
    teacher = teacher_logits[:, :-1].reshape(-1, vocabulary)
    labels = ids[:, 1:].reshape(-1)
    return _LanguageModelAndDistillation.apply(student, teacher, labels)
