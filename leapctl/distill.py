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
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    return logits.div_(softcap).tanh_().mul_(softcap) if softcap else logits


def _matmul_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype the heads' matmuls run in: autocast's when it is on (the weights are then cast once per call,
    where autocast casts a frozen weight again at every op: 28M numbers a chunk for SmolLM2's head)."""
    device_type = tensor.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else tensor.dtype


class _HeadDistillation(torch.autograd.Function):
    """KL(teacher || student) of the logits two output heads give final hidden states, a chunk of positions
    at a time. Its gradients, (p - q) (x the soft cap's slope) times the head's weight for the hidden states
    and (p - q)^T times the hidden states for the head (when it is trained), are made in the same pass and
    kept: [positions, hidden] and the head's shape, where whole logits kept [positions, vocabulary] for the
    backward (SmolLM2: 2.3 MB against 200 MB a step)."""

    @staticmethod
    def forward(ctx, hidden, teacher_hidden, weight, bias, teacher_weight, teacher_bias, softcap, chunk):
        positions, dtype = hidden.shape[0], _matmul_dtype(weight)
        trains_weight, trains_bias = ctx.needs_input_grad[2], bias is not None and ctx.needs_input_grad[3]
        cast = [None if t is None else t.to(dtype) for t in (weight, bias, teacher_weight, teacher_bias)]
        grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if trains_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if trains_bias else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):  # the dtype is chosen above
            for start in range(0, positions, chunk):
                rows = slice(start, start + chunk)
                inputs = hidden[rows].to(dtype)
                student = _capped_logits(inputs, cast[0], cast[1], softcap)
                log_p = torch.log_softmax(student, dim=-1)
                log_q = torch.log_softmax(_capped_logits(teacher_hidden[rows].to(dtype), cast[2], cast[3],
                                                         softcap), dim=-1)
                q = log_q.exp()
                total += log_q.sub_(log_p).mul_(q).sum()
                slope = log_p.exp_().sub_(q)  # d KL / d logits, per position
                if softcap:
                    slope.mul_(student.div_(softcap).square_().neg_().add_(1.0))
                if grad_bias is not None:
                    grad_bias += slope.sum(0)
                slope = slope.to(dtype)  # as the head's own backward
                grad_hidden[rows] = torch.matmul(slope, cast[0])
                if grad_weight is not None:
                    grad_weight += torch.matmul(slope.t(), inputs)
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total / positions

    @staticmethod
    def backward(ctx, grad_kl: torch.Tensor):
        saved = ctx.saved_tensors
        scale = grad_kl / saved[0].shape[0]
        grads = [None if g is None else g.mul(scale).to(d) for g, d in zip(saved, ctx.dtypes, strict=True)]
        return grads[0], None, grads[1], grads[2], None, None, None, None


def head_distillation(hidden: torch.Tensor, teacher_hidden: torch.Tensor, head: torch.nn.Linear,
                      teacher_head: torch.nn.Linear, softcap: float | None = None) -> torch.Tensor:
    """KL(teacher || student), a mean over the positions the LM loss predicts (every position but each
    sequence's last), from the final hidden states [batch, sequence, hidden] of two models and their output
    heads (`softcap`: Gemma's final logit soft cap), without ever holding whole logits: the same value and
    gradients (the student's hidden states, and its head's weight and bias when they are trained) as
    `language_model_and_distillation`'s KL of the heads' logits."""
    student = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    teacher = teacher_hidden[:, :-1].reshape(-1, teacher_hidden.shape[-1])
    budget = CPU_CHUNK_BYTES if hidden.device.type == "cpu" else GPU_CHUNK_BYTES
    chunk = max(1, budget // (4 * head.out_features))
    return _HeadDistillation.apply(student, teacher, head.weight, head.bias, teacher_head.weight,
                                   teacher_head.bias, softcap, chunk)


def model_distillation(student: torch.nn.Module, teacher: torch.nn.Module, ids: torch.Tensor,
                       output_hidden_states: bool = False):
    """Both causal LMs' decoders on `ids` (the teacher without gradients; under the caller's autocast) and
    `head_distillation` of their final hidden states through their own output heads, with the student's
    config's soft cap: (KL, the student's decoder output, the teacher's), the outputs for callers that also
    compare block outputs (`output_hidden_states`)."""
    inputs = dict(input_ids=ids, use_cache=False, output_hidden_states=output_hidden_states)
    with torch.no_grad():
        dense = teacher.get_decoder()(**inputs)
    sparse = student.get_decoder()(**inputs)
    softcap = getattr(student.config.get_text_config(), "final_logit_softcapping", None)
    kl = head_distillation(sparse.last_hidden_state, dense.last_hidden_state, student.get_output_embeddings(),
                           teacher.get_output_embeddings(), softcap)
    return kl, sparse, dense
