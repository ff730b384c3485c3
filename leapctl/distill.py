"""The distillation loss every training loop here uses (LEAP's `learn`, `recover`, `quantize`'s scale
tuning): the student's LM loss and its KL to a teacher's logits, from one log-softmax, with a hand-written
backward; and the KL alone from final hidden states and frozen output heads, a chunk of positions at a time
(`recover`), which never holds whole logits. Its own module so that those packages share it without
importing one another."""

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


# The [positions, vocabulary] buffers of `head_distillation`, a chunk of positions at a time. On a CPU under
# glibc's 32 MB ceiling for heap blocks: a larger block is a mapping of its own, mapped anew and faulted in
# page by page every step (SmolLM2's recovery with whole logits: 550k page faults a step, 17% of its CPU time
# in the kernel). On a GPU, few launches with bounded memory (Llama-3.1-8B's 128k vocabulary at 16k
# positions: 8 GiB a buffer whole).
CPU_CHUNK_BYTES, GPU_CHUNK_BYTES = 16 << 20, 1 << 30


def _capped_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   softcap: float | None) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias).float()
    return logits.div_(softcap).tanh_().mul_(softcap) if softcap else logits


def _matmul_weights(head: torch.nn.Linear, device_type: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's weight and bias in the dtype its matmuls run in (autocast's, when on), cast once per call:
    autocast casts a frozen weight again at every op, 28M numbers a chunk for SmolLM2's head."""
    dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
             else head.weight.dtype)
    return head.weight.to(dtype), None if head.bias is None else head.bias.to(dtype)


class _HeadDistillation(torch.autograd.Function):
    """KL(teacher || student) of the logits two frozen output heads give final hidden states, a chunk of
    positions at a time. Its gradient w.r.t. the student's hidden states, (p - q) (x the soft cap's slope)
    times the head's weight, is made in the same pass and kept: [positions, hidden], where whole logits kept
    [positions, vocabulary] for the backward (SmolLM2: 2.3 MB against 200 MB a step)."""

    @staticmethod
    def forward(ctx, hidden, teacher_hidden, head, teacher_head, softcap, chunk):
        positions, device_type = hidden.shape[0], hidden.device.type
        weight, bias = _matmul_weights(head, device_type)
        teacher_weight, teacher_bias = ((weight, bias) if teacher_head is head
                                        else _matmul_weights(teacher_head, device_type))
        grad = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(device_type, enabled=False):  # the dtypes are chosen above
            for start in range(0, positions, chunk):
                rows = slice(start, start + chunk)
                student = _capped_logits(hidden[rows], weight, bias, softcap)
                log_p = torch.log_softmax(student, dim=-1)
                log_q = torch.log_softmax(_capped_logits(teacher_hidden[rows], teacher_weight, teacher_bias,
                                                         softcap), dim=-1)
                q = log_q.exp()
                total += log_q.sub_(log_p).mul_(q).sum()
                slope = log_p.exp_().sub_(q)  # d KL / d logits, per position
                if softcap:
                    slope.mul_(student.div_(softcap).square_().neg_().add_(1.0))
                grad[rows] = torch.matmul(slope.to(weight.dtype), weight)  # as the head's own backward
        ctx.save_for_backward(grad)
        ctx.hidden_dtype = hidden.dtype
        return total / positions

    @staticmethod
    def backward(ctx, grad_kl: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad.mul(grad_kl / grad.shape[0]).to(ctx.hidden_dtype), None, None, None, None, None


def head_distillation(hidden: torch.Tensor, teacher_hidden: torch.Tensor, head: torch.nn.Linear,
                      teacher_head: torch.nn.Linear, softcap: float | None = None) -> torch.Tensor:
    """KL(teacher || student), a mean over the positions the LM loss predicts (every position but each
    sequence's last), from the final hidden states [batch, sequence, hidden] of two models and their frozen
    output heads (`softcap`: Gemma's final logit soft cap), without ever holding whole logits: the same value
    and gradient as `language_model_and_distillation`'s KL of the heads' logits."""
    trained = head.weight.requires_grad or (head.bias is not None and head.bias.requires_grad)
    if trained and torch.is_grad_enabled():
        raise ValueError("head_distillation gives no gradient to the output head: freeze it")
    student = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    teacher = teacher_hidden[:, :-1].reshape(-1, teacher_hidden.shape[-1])
    budget = CPU_CHUNK_BYTES if hidden.device.type == "cpu" else GPU_CHUNK_BYTES
    chunk = max(1, budget // (4 * head.out_features))
    return _HeadDistillation.apply(student, teacher, head, teacher_head, softcap, chunk)
