"""The learnable mask: one logit per prunable weight, relaxed with the Gumbel-sigmoid.

`M = sigmoid((alpha * P + g) / tau)` with g logistic noise while training. The weight W stays frozen and
only P is trained, unless the weights are learned with the mask (`MaskState.train_weights`, `learn
--weight-lr`): then W gets the gradient of W * M too, and a frozen copy of the dense W stays beside it for
the distillation teacher. `MaskedLinear` applies the mask inside the forward through `MaskedLinearFunction`,
which keeps only x, W and P for the backward and recomputes M (and W*M) there, so no full-size copy
of W, M or the noise outlives one layer's forward or backward.

The noise is not drawn from the global RNG: each layer draws it from a generator seeded with
(run seed, optimizer step, global micro-batch index, layer index). The same sample therefore comes
back in the backward, in gradient-checkpoint recomputation, after a resume and on every data-parallel
rank that processes that micro-batch."""

import functools
import hashlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

UNIFORM_EPS = 1e-6  # keeps log(u) - log(1-u) finite; caps |g| at about 13.8
NOISE_CHUNK = 1 << 16  # CPU noise is drawn in pieces of this many numbers, each from its own seed
# |(alpha * P + g) / tau| is capped here before the sigmoid. Late in the schedule alpha / tau passes 100 and
# pruned weights get M below 1e-38: W * M is then subnormal, and CPU matmuls on subnormal operands run ~100x
# slower (SmolLM2 steps went from 20 s to 208 s). torch.set_flush_denormal only reaches the calling thread,
# not the intra-op pool. sigmoid(-30) = 9.4e-14 keeps W * M normal, is below fp32 resolution next to any kept
# weight, and its slope M(1 - M) still reaches the backward as a negligible, normal gradient.
SATURATION = 30.0


def noise_seed(run_seed: int, step: int, micro_batch: int, layer: int) -> int:
    """A 63-bit seed for one layer's noise in one micro-batch; independent of process and world size."""
    digest = hashlib.blake2b(f"{run_seed}:{step}:{micro_batch}:{layer}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _chunk_seed(seed: int, chunk: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _uniform_cpu(numel: int, seed: int) -> torch.Tensor:
    """U(0, 1) draws in NOISE_CHUNK pieces, each from its own generator, filled on a thread pool: the CPU
    generator (mt19937) is serial, ~10 ns a number. The pieces do not depend on the thread count."""
    u = torch.empty(numel, dtype=torch.float32, device="cpu")

    def fill(chunk: int) -> None:
        generator = torch.Generator()
        generator.manual_seed(_chunk_seed(seed, chunk))
        start = chunk * NOISE_CHUNK
        piece = u[start : start + NOISE_CHUNK]
        torch.rand(piece.numel(), generator=generator, out=piece, device="cpu")

    chunks = range((numel + NOISE_CHUNK - 1) // NOISE_CHUNK)
    threads = torch.get_num_threads()
    if threads == 1 or len(chunks) == 1:
        for chunk in chunks:
            fill(chunk)
    else:
        list(_noise_pool(threads).map(fill, chunks))
    return u


@functools.cache
def _noise_pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="leap-noise")


def logistic_noise(shape: torch.Size, seed: int, device: torch.device) -> torch.Tensor:
    """g = logit(u) = log(u) - log(1 - u), u ~ U(0, 1): the difference of two Gumbels, drawn reproducibly
    from `seed`. CUDA draws in one call (Philox is parallel); the CPU in parallel chunks."""
    numel = torch.Size(shape).numel()
    if device.type == "cpu":
        u = _uniform_cpu(numel, seed)
    else:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        u = torch.rand(numel, generator=generator, device=device, dtype=torch.float32)
    return torch.logit_(u, eps=UNIFORM_EPS).view(shape)


def soft_mask(logits: torch.Tensor, alpha: float, tau: float, seed: int | None) -> torch.Tensor:
    """sigmoid((alpha * P + g) / tau) in fp32, the argument capped at +-SATURATION; no noise when `seed` is
    None (evaluation)."""
    z = logits.float() * alpha
    if seed is not None:
        z += logistic_noise(logits.shape, seed, logits.device)
    return torch.sigmoid_(z.div_(tau).clamp_(-SATURATION, SATURATION))


class MaskedLinearFunction(torch.autograd.Function):
    """y = x @ (W * M)^T + b, plus two scalars the regularisers need: sum(M) and ||W * M||_F^2 (the
    latter only with `track_norm`; without the magnitude term it is a constant 0 and costs nothing).

    Saves only references to x, W and P; the backward recomputes M from the same seed. Gradients flow
    to P, and to W when it requires them (the weights learned with the mask): the task's gradient of W * M
    times M. The magnitude term is the mask's regulariser, not the weights': it rewards a larger ||W * M||,
    which would only grow W, so W gets none of it. b is frozen. Matmuls run in `compute_dtype` (bf16 under
    autocast), M in fp32."""

    @staticmethod
    def forward(ctx, x, weight, bias, logits, alpha, tau, seed, compute_dtype, track_norm):
        ctx.set_materialize_grads(False)  # an unused scalar output gets no gradient pass over W
        with torch.autocast(device_type=x.device.type, enabled=False):
            mask = soft_mask(logits, alpha, tau, seed)
            masked = weight.float() * mask
            mask_sum = mask.sum()
            masked_norm_sq = masked.square().sum() if track_norm else torch.zeros((), device=x.device)
            masked_c = masked.to(compute_dtype)
            del masked, mask
            y = x.to(compute_dtype) @ masked_c.t()
            if bias is not None:
                y = y + bias.to(compute_dtype)
        if not track_norm:
            ctx.mark_non_differentiable(masked_norm_sq)
        ctx.save_for_backward(x, weight, logits)
        ctx.alpha, ctx.tau, ctx.seed, ctx.compute_dtype = alpha, tau, seed, compute_dtype
        return y, mask_sum, masked_norm_sq

    @staticmethod
    def backward(ctx, grad_y, grad_mask_sum, grad_norm_sq):
        x, weight, logits = ctx.saved_tensors
        with torch.autocast(device_type=x.device.type, enabled=False):
            mask = soft_mask(logits, ctx.alpha, ctx.tau, ctx.seed)
            w = weight.float()
            grad_y = grad_y.to(ctx.compute_dtype)
            grad_x = None
            if ctx.needs_input_grad[0]:
                grad_x = (grad_y @ (w * mask).to(ctx.compute_dtype)).to(x.dtype)
            grad_masked = grad_y.reshape(-1, grad_y.shape[-1]).t() @ x.to(ctx.compute_dtype).reshape(
                -1, x.shape[-1]
            )
            grad_weight = None
            if ctx.needs_input_grad[1]:  # before grad_masked is scaled in place below (fp32: the same tensor)
                grad_weight = (grad_masked.float() * mask).to(weight.dtype)
            grad_mask = grad_masked.float().mul_(w)
            if grad_mask_sum is not None:
                grad_mask += grad_mask_sum
            if grad_norm_sq is not None:
                grad_mask += (2.0 * grad_norm_sq) * mask * w.square()
            # dM/dP = (alpha / tau) * M * (1 - M)
            grad_logits = grad_mask.mul_(mask).mul_(1.0 - mask).mul_(ctx.alpha / ctx.tau).to(logits.dtype)
        return grad_x, grad_weight, None, grad_logits, None, None, None, None, None


@dataclass
class MaskState:
    """What every masked layer needs to know for the current forward: temperature schedule values,
    whose noise to draw, and where to record the regulariser scalars."""

    run_seed: int = 0
    alpha: float = 25.0
    tau: float = 4.0
    step: int = 0
    micro_batch: int = 0
    noisy: bool = True
    enabled: bool = True  # False: the plain dense layers (the distillation teacher's forward)
    compute_dtype: torch.dtype = torch.float32
    track_norms: bool = True  # record ||W * M||_F^2 (the magnitude term needs it)
    train_weights: bool = False  # W is trained with the logits (read when the layers are attached)
    dense_teacher: bool = False  # with train_weights: keep the dense W frozen for the teacher's forward
    recording: bool = False
    mask_sums: list = field(default_factory=list)
    masked_norms_sq: list = field(default_factory=list)

    def start_micro_batch(self, step: int, micro_batch: int) -> None:
        """Reset the records; only the forward pass records (not checkpoint recomputation in backward)."""
        self.step, self.micro_batch = step, micro_batch
        self.mask_sums, self.masked_norms_sq = [], []
        self.recording = True


class MaskedLinear(nn.Module):
    """Drop-in replacement of a prunable `nn.Linear`: same weight and bias, plus `mask_logits`. The weight
    is frozen, or trained when `state.train_weights`; then, with `state.dense_teacher`, `dense_weight` is a
    frozen copy of it as it came (a parameter, so FSDP2 shards it with the block) for the teacher."""

    def __init__(self, linear: nn.Linear, logits: torch.Tensor, state: MaskState, layer_index: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.weight.requires_grad_(state.train_weights)
        self.dense_weight = None
        if state.train_weights and state.dense_teacher:
            self.dense_weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.mask_logits = nn.Parameter(logits)
        self.state = state
        self.layer_index = layer_index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.state
        if not s.enabled:
            dense = self.dense_weight if self.dense_weight is not None else self.weight
            return nn.functional.linear(x, dense, self.bias)
        seed = noise_seed(s.run_seed, s.step, s.micro_batch, self.layer_index) if s.noisy else None
        y, mask_sum, norm_sq = MaskedLinearFunction.apply(
            x, self.weight, self.bias, self.mask_logits, s.alpha, s.tau, seed, s.compute_dtype, s.track_norms
        )
        if s.recording:
            s.mask_sums.append(mask_sum)
            s.masked_norms_sq.append(norm_sq)
        return y


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def attach_masks(
    model: nn.Module, linears: dict[str, nn.Linear], logits: dict[str, torch.Tensor], state: MaskState,
    first_index: int = 0,
) -> dict[str, MaskedLinear]:
    """Swap each named linear for a `MaskedLinear` holding its logits (keyed by `<name>.weight`); layer
    indices (which seed the noise) count from `first_index`, for a model attached a block at a time."""
    masked = {}
    for index, (name, linear) in enumerate(linears.items(), start=first_index):
        layer = MaskedLinear(linear, logits[f"{name}.weight"], state, index)
        _set_submodule(model, name, layer)
        masked[name] = layer
    return masked


def detach_masks(model: nn.Module, masked: dict[str, MaskedLinear]) -> None:
    """Put plain `nn.Linear` modules back (same weight tensors), e.g. before saving the checkpoint."""
    for name, layer in masked.items():
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        linear.weight = layer.weight
        linear.weight.requires_grad_(False)
        if layer.bias is not None:
            linear.bias = layer.bias
        _set_submodule(model, name, linear)


def init_logits(
    keep_masks: dict[str, torch.Tensor],
    mode: str,
    scale: float,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Initial logits from a keep-mask (True = kept).

    `wanda` (paper): +scale kept, -scale pruned. `wanda-small` (authors' code): N(0, 0.014) plus
    +-3 * 0.014, i.e. small logits that start well inside the sigmoid's slope. For the `random`
    ablation the caller passes a random keep-mask of the same density."""
    out = {}
    for name, keep in keep_masks.items():
        sign = keep.float() * 2.0 - 1.0
        if mode == "wanda-small":
            std = 0.014
            noise = torch.randn(keep.shape, generator=generator) * std
            out[name] = (noise + sign * 3.0 * std).to(dtype)
        else:
            out[name] = (sign * scale).to(dtype)
    return out


# Elements compared at once by `hard_masks`: bounds its temporaries (bf16 logits are widened a chunk at a
# time).
COMPARE_CHUNK = 1 << 24
# The order keys of -inf and +inf: float32 bit patterns mapped to integers of the same order (negative values
# reflected), so that bisecting over the integers between them visits every float32 in order.
KEY_NEG_INF, KEY_POS_INF = -(0x7F800000 + 1), 0x7F800000


def _key_value(key: torch.Tensor) -> torch.Tensor:
    """The float32 values whose order keys are `key` (int64 in the int32 range): the inverse of the order
    map, computed for the few thresholds only, never for the weights. -0.0 and +0.0 compare equal, so the
    two keys around zero count alike."""
    bits = torch.where(key < 0, key ^ 0x7FFFFFFF, key).to(torch.int32)
    return bits.view(torch.float32)


def _chunks(p: torch.Tensor) -> list[torch.Tensor]:
    return list(p.reshape(-1).split(COMPARE_CHUNK))


def _count(p: torch.Tensor, value: torch.Tensor, op) -> torch.Tensor:
    """How many elements of `p` satisfy `op(element, value)`, compared in float32 a chunk at a time
    (`count_nonzero`: a boolean tensor's `sum` widens it to int64, ~9x slower on a CPU)."""
    return sum(torch.count_nonzero(op(chunk.float(), value)) for chunk in _chunks(p))


def hard_masks(
    logits: dict[str, torch.Tensor], density: float, mode: str = "global", group=None
) -> dict[str, torch.Tensor]:
    """Boolean keep-masks from trained logits.

    `global` (default): exactly round(density * total) weights kept, those with the largest logits over
    all layers together: `torch.topk` over the concatenated logits, with ties at the threshold going to
    the earlier layer, then the lower flat index (a stable descending sort). Found by bisection over the
    float32 order (32 passes of counts), so nothing of model size is concatenated, sorted or widened to
    integer keys: each pass compares the logits with one threshold, a chunk at a time.
    `per-layer`: round(density * numel) kept in every layer, by the same rule. `positive` (authors' code):
    P > 0. NaN logits are refused (they have no place in the order).

    With a process `group`, each tensor is this process's shard of its layer: a contiguous block of rows,
    the shards in rank order (FSDP2's dim-0 sharding). Counts are summed over the group on the logits'
    device, so every process gets its shard of the same masks one process would get from the full logits."""
    if mode == "positive":
        return {name: p > 0 for name, p in logits.items()}
    if mode not in ("global", "per-layer"):
        raise ValueError(f"unknown hard-mask mode {mode!r}")
    names = list(logits)
    device = next(iter(logits.values())).device
    sizes_and_nans = _group_sum(torch.stack([
        torch.stack([torch.tensor(logits[n].numel(), device=device),
                     torch.count_nonzero(torch.isnan(logits[n]))])
        for n in names]), group)
    if int(sizes_and_nans[:, 1].sum()):
        raise ValueError("the mask logits hold NaN: the run diverged")
    sizes = sizes_and_nans[:, 0]
    members = [list(range(len(names)))] if mode == "global" else [[i] for i in range(len(names))]
    totals = [int(sum(sizes[i] for i in layers)) for layers in members]
    k = torch.tensor([round(density * total) for total in totals], device=device)

    def counts(values: torch.Tensor, op) -> torch.Tensor:
        """Per set of layers: how many logits x satisfy op(x, the set's threshold value)."""
        local = torch.stack([sum(_count(logits[names[i]], values[g], op) for i in layers)
                             for g, layers in enumerate(members)])
        return _group_sum(local, group)

    # per set: the largest key t with count(x >= value(t)) >= k, all sets bisected together; every key
    # between those of -inf and +inf is a number, and count(x >= -inf) = size >= k
    low = torch.full((len(members),), KEY_NEG_INF, dtype=torch.long, device=device)
    high = torch.full((len(members),), KEY_POS_INF, dtype=torch.long, device=device)
    while bool((low < high).any()):
        mid = (low + high + 1) // 2
        enough = counts(_key_value(mid), torch.ge) >= k
        low = torch.where(enough, mid, low)
        high = torch.where(enough, high, mid - 1)
    threshold = _key_value(low)
    remaining = (k - counts(threshold, torch.gt)).tolist()
    # ties at the threshold, in layer order and within a layer in rank (row) order
    ties = torch.stack([_count(logits[names[i]], threshold[g], torch.eq)
                        for g, layers in enumerate(members) for i in layers])
    every = _group_gather(ties, group)  # [processes, layers]
    rank = dist.get_rank(group) if group is not None else 0
    out, position = {}, 0
    for g, layers in enumerate(members):
        for i in layers:
            before = int(every[:rank, position].sum())
            take = max(0, min(int(every[rank, position]), remaining[g] - before))
            out[names[i]] = _keep_above(logits[names[i]], threshold[g], take)
            remaining[g] = max(0, remaining[g] - int(every[:, position].sum()))
            position += 1
    return out


def _keep_above(p: torch.Tensor, value: torch.Tensor, take: int) -> torch.Tensor:
    """Keep-mask of `p`: every element above `value`, and the first `take` (in flat order) equal to it."""
    keep = torch.empty(p.shape, dtype=torch.bool, device=p.device)
    for chunk, out in zip(_chunks(p), _chunks(keep), strict=True):
        wide = chunk.float()
        torch.gt(wide, value, out=out)
        if take:
            tied = (wide == value).nonzero().flatten()[:take]
            out[tied] = True
            take -= tied.numel()
    return keep


def _group_sum(values: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        values = values.clone()
        dist.all_reduce(values, group=group)
    return values


def _group_gather(values: torch.Tensor, group) -> torch.Tensor:
    if group is None:
        return values.unsqueeze(0)
    parts = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, values, group=group)
    return torch.stack(parts)
