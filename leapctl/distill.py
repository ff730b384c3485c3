"""The distillation loss every training loop here uses (LEAP's `learn`, `recover`, `quantize`'s scale
tuning): the student's LM loss and its KL to a teacher's logits, from one log-softmax, with a hand-written
backward. Its own module so that those packages share it without importing one another."""

import torch


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
