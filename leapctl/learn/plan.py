"""The memory plan of a `learn` run: the peak it expects on each device, from the model's config alone (the
model is built on the meta device, nothing is read or allocated), so that a run that cannot fit is refused
with one line before it loads anything, and `learn --plan` answers "does LLaMA-3.1 8B fit 4 x 80 GB?" on a
machine without the GPUs.

Per device (one process), for the configuration given:
- resident for the whole run: the frozen weights (`--dtype`), the mask logits, their gradients and AdamW's
  two moments (`--logits-dtype`); divided by the processes under FSDP2, whole on every process under DDP
  (which also keeps a bucketed copy of the gradients); with `--weight-lr` the masked weights' gradients and
  AdamW moments too (float32), and the teacher's frozen copy of them when distilling;
- FSDP2's unsharded parameters: two blocks in flight (the running one and the prefetched one), the running
  block's unsharded logit gradients before their reduce-scatter, and the root's parameters (embeddings,
  lm_head), which FSDP2 keeps unsharded from the forward to the backward;
- activations of one micro-batch: with gradient checkpointing each block's input, plus one block recomputed
  in the backward; without, every block's;
- the larger of two transients: the output logits and the loss (`--distill`: the dense teacher's logits
  too, and the float32 log-softmaxes), or a masked linear's soft mask, W * M and their gradients (the
  largest layer, whole);
- at the start, before sharding: the whole model in `--dtype` on every process, on rank 0 with Wanda's
  calibration hidden states; at the end, the hard mask, and on a CPU what rank 0 gathers whole into its
  RAM (the masks; the logits with `--save-logits`; the weights with `--weight-lr` under FSDP2).
The peak is the largest of start, training and end; a runtime allowance (CUDA context, NCCL, the
allocator's slack; the interpreter on a CPU) comes on top."""

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from leapctl.compute import DTYPES
from leapctl.errors import LeapctlError
from leapctl.learn.config import LearnConfig

GB = 10**9
PLANNED_GPU_GB = 80.0  # an H100 / A100 80 GB: the device assumed when planning for a GPU this machine lacks
ALLOWANCE = {"cuda": (2 * GB, 0.10), "cpu": (GB // 2, 0.05)}  # fixed bytes, share of the tensors' peak
LINEAR_TEMPORARIES = 5  # float32 copies of a layer alive at once in a masked linear's backward (mask.py)


@dataclass(frozen=True)
class ModelSizes:
    """The numbers of a model the plan needs (element counts, not bytes)."""

    params: int  # every parameter, tied ones once
    masked: int  # the weights that get mask logits
    root: int  # parameters outside the decoder blocks (embeddings, final norm, lm_head)
    block: int  # the largest block's parameters
    block_masked: int  # the largest block's masked weights
    largest_linear: int
    layers: int
    hidden: int
    intermediate: int
    kv_hidden: int  # key/value heads x head dimension
    vocab: int


@dataclass(frozen=True)
class Setup:
    """The run the plan is for."""

    world: int
    fsdp: bool
    device_type: str  # "cuda" or "cpu"
    tokens: int  # per micro-batch: micro-batch size x sequence length
    weight_bytes: int
    logit_bytes: int
    activation_bytes: int  # bf16 under autocast or bf16 weights, else 4
    distill: bool
    checkpointing: bool
    wanda: bool  # rank 0 computes the initial mask (calibration hidden states on the device)
    calib_tokens: int  # nsamples x sequence length
    train_weights: bool = False  # --weight-lr: the masked weights learned with the logits
    save_logits: bool = False  # --save-logits: rank 0 gathers the whole trained logits at the end

    @property
    def shards(self) -> int:
        return self.world if self.fsdp and self.world > 1 else 1

    @property
    def ddp(self) -> bool:
        return self.world > 1 and not self.fsdp


@dataclass
class MemoryPlan:
    """Rows of (what, bytes per device) for each phase, the peak with its allowance, and the memory."""

    title: str
    training: list[tuple[str, int]]
    start: list[tuple[str, int]]
    end: list[tuple[str, int]]
    allowance: int
    memory: int
    memory_source: str

    @property
    def tensors_peak(self) -> int:
        """The largest phase's tensors, without the runtime allowance (what a tensor count measures)."""
        return max(sum(b for _, b in rows) for rows in (self.training, self.start, self.end))

    @property
    def peak(self) -> int:
        return self.tensors_peak + self.allowance

    @property
    def fits(self) -> bool:
        return self.peak <= self.memory

    def table(self) -> str:
        width, (unit, size) = 70, ("GB", GB) if self.peak >= GB else ("MB", 10**6)
        rows = [(f"{phase}: {name}", b) for phase, phase_rows in
                (("training", self.training), ("start", self.start), ("end", self.end))
                for name, b in [*phase_rows, ("total", sum(b for _, b in phase_rows))]]
        rows += [("runtime allowance (context, communication, allocator slack)", self.allowance),
                 ("expected peak", self.peak), (f"device memory ({self.memory_source})", self.memory)]
        lines = [f"memory plan: {self.title}", f"  {unit + ' per device':>{width + 8}}"]
        lines += [f"  {name:<{width}}{b / size:>8.2f}" for name, b in rows]
        return "\n".join(lines) + f"  -> {'fits' if self.fits else 'does NOT fit'}"

    def summary(self) -> str:
        return (f"memory plan: {self.title}: expected peak {self.peak / GB:.1f} GB per device of "
                f"{self.memory / GB:.1f} GB ({self.memory_source}); learn --plan shows the table")

    def refusal(self) -> str:
        return (f"learn would not fit: {self.title} expects {self.peak / GB:.1f} GB per device, the device "
                f"has {self.memory / GB:.1f} GB ({self.memory_source}); see learn --plan, try --fsdp, "
                f"--dtype bfloat16, a smaller --micro-batch-size or --seq-len")


def model_sizes(model: torch.nn.Module, include: str | None = None, exclude: str | None = None) -> ModelSizes:
    """`ModelSizes` of a model (real or on the meta device)."""
    from leapctl.models import model_layout

    layout = model_layout(model, include, exclude)
    masked = {id(linear.weight): linear.weight.numel() for linear in layout.linears.values()}
    in_blocks = {id(p) for p in layout.blocks.parameters()}
    config = model.config
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    return ModelSizes(
        params=sum(p.numel() for p in model.parameters()),
        masked=sum(masked.values()),
        root=sum(p.numel() for p in model.parameters() if id(p) not in in_blocks),
        block=max(sum(p.numel() for p in block.parameters()) for block in layout.blocks),
        block_masked=max(sum(masked.get(id(p), 0) for p in block.parameters()) for block in layout.blocks),
        largest_linear=max(masked.values()),
        layers=len(layout.blocks),
        hidden=hidden,
        intermediate=config.intermediate_size,
        kv_hidden=getattr(config, "num_key_value_heads", heads) * head_dim,
        vocab=config.vocab_size,
    )


def estimate(sizes: ModelSizes, setup: Setup) -> tuple[list, list, list]:
    """(training, start, end) rows of bytes per device; see the module docstring."""
    s, bw, bl = setup.shards, setup.weight_bytes, setup.logit_bytes
    share = f" (1/{s} each)" if s > 1 else ""
    resident = [
        (f"frozen weights{share}", sizes.params * bw // s),
        (f"mask logits{share}", sizes.masked * bl // s),
        (f"logit gradients{share}" + (" + DDP buckets" if setup.ddp else ""),
         sizes.masked * bl // s * (2 if setup.ddp else 1)),
        (f"AdamW moments{share}", 2 * sizes.masked * bl // s),
    ]
    if setup.train_weights:  # float32 weights (checked), so gradients and moments are 4 bytes an element
        resident += [
            (f"weight gradients{share}" + (" + DDP buckets" if setup.ddp else ""),
             sizes.masked * 4 // s * (2 if setup.ddp else 1)),
            (f"weights' AdamW moments{share}", 2 * sizes.masked * 4 // s),
        ]
        if setup.distill:
            resident.append((f"the teacher's dense copy of the weights{share}", sizes.masked * bw // s))
    if s > 1:
        blocks = 2 * (sizes.block * bw + sizes.block_masked * bl) + sizes.block_masked * bl
        unsharded = blocks + sizes.root * bw
        resident.append(("FSDP2 unsharded: 2 blocks, 1 block's gradients, the root", unsharded))
    training = resident + [("activations of one micro-batch", _activations(sizes, setup)),
                           _largest_transient(sizes, setup)]
    whole = sizes.params * bw
    start = [("whole model before sharding" if s > 1 else "whole model", whole)]
    if setup.wanda:  # Wanda's hidden states in and out of a block, in the weights' dtype
        start.append(("Wanda calibration hidden states (rank 0)", 2 * setup.calib_tokens * sizes.hidden * bw))
    logit_start = (sizes.block_masked if s > 1 else sizes.masked) * (bl + 1)  # logits and their keep-mask
    start.append(("initial logits" + (" of one block, before sharding" if s > 1 else ""), logit_start))
    on_host = setup.device_type == "cpu"  # what rank 0 gathers whole to the host is then on the device too
    end = resident[:2] + [resident[3], ("hard mask (bool), and the whole masks in RAM (rank 0)",
                                        sizes.masked // s + (sizes.masked if on_host else 0))]
    if on_host and setup.save_logits:
        end.append(("the whole trained logits, float32 (rank 0)", sizes.masked * 4))
    if on_host and setup.train_weights and s > 1:
        end.append(("the whole trained weights, gathered for the pruned copy (rank 0)", sizes.masked * 4))
    return training, start, end


def _activations(sizes: ModelSizes, setup: Setup) -> int:
    """Saved activations of one micro-batch (HF Llama-style blocks, sdpa attention)."""
    t, h, i, ba = setup.tokens, sizes.hidden, sizes.intermediate, setup.activation_bytes
    # one block: norms' fp32 inputs, q/k/v before and after rotary, attention output, o_proj and MLP inputs,
    # gate, up, act(gate) and their product
    per_block = t * (2 * h * 4 + (6 * h + 4 * sizes.kv_hidden + 4 * i) * ba)
    if setup.checkpointing:
        return sizes.layers * t * h * ba + per_block
    return sizes.layers * per_block


def _largest_transient(sizes: ModelSizes, setup: Setup) -> tuple[str, int]:
    tv, ba = setup.tokens * sizes.vocab, setup.activation_bytes
    if setup.distill:  # teacher and student logits, their shifted copies, log p, log q, q
        logits = ("output logits and loss (with the teacher's)", tv * (4 * ba + 3 * 4))
    else:  # the logits, their float32 copy, the saved log-softmax
        logits = ("output logits and loss", tv * (ba + 4 + (4 if ba != 4 else 0)))
    linear = ("masked linear's temporaries (largest layer)",
              sizes.largest_linear * (LINEAR_TEMPORARIES * 4 + 4))
    return max(logits, linear, key=lambda row: row[1])


def memory_plan(config: LearnConfig, world: int, device_type: str) -> MemoryPlan:
    """The plan for a checked `config` run by `world` processes on `device_type` ("cuda" or "cpu")."""
    model = meta_model(config.model, DTYPES[config.dtype])
    sizes = model_sizes(model, config.include, config.exclude)
    setup = run_setup(config, world, device_type)
    training, start, end = estimate(sizes, setup)
    memory, source = device_memory(config, device_type, world)
    fixed, share = ALLOWANCE[device_type]
    plan = MemoryPlan(_title(config, sizes, setup), training, start, end, 0, memory, source)
    plan.allowance = fixed + int(share * plan.tensors_peak)
    return plan


def run_setup(config: LearnConfig, world: int, device_type: str) -> Setup:
    """The `Setup` of a checked `config`; autocast as `learn` resolves it for that device."""
    autocast = config.autocast if config.autocast is not None else device_type == "cuda"
    micro = config.micro_batch_size or config.batch_size // world
    wanda = not config.resume and config.init != "random" and config.init_masks is None
    return Setup(world=world, fsdp=config.fsdp, device_type=device_type, tokens=micro * config.seq_len,
                 weight_bytes=DTYPES[config.dtype].itemsize, logit_bytes=DTYPES[config.logits_dtype].itemsize,
                 activation_bytes=2 if autocast or config.dtype == "bfloat16" else 4,
                 distill=bool(config.distill), checkpointing=config.gradient_checkpointing, wanda=wanda,
                 calib_tokens=config.nsamples * config.seq_len, train_weights=config.weight_lr > 0,
                 save_logits=config.save_logits)


def _title(config: LearnConfig, sizes: ModelSizes, setup: Setup) -> str:
    mode = "FSDP2" if setup.shards > 1 else ("DDP" if setup.ddp else "one process")
    return (f"{Path(config.model).name} ({sizes.params / 1e9:.2f}B parameters, {sizes.masked / 1e9:.2f}B "
            f"masked) on {setup.world} x {setup.device_type}, {mode}, {setup.tokens // config.seq_len} x "
            f"{config.seq_len} tokens a micro-batch, weights {config.dtype}, logits {config.logits_dtype}")


def meta_model(spec: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model `spec` names, built from its config on the meta device (no weights read or allocated)."""
    from transformers import AutoModelForCausalLM

    config = _model_config(spec)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _model_config(spec: str):
    """The transformers config of MODEL: a folder (only config.json is read), a built-in name, or a hub id
    (only its config.json is fetched)."""
    from transformers import AutoConfig

    from leapctl.builtin_models import BUILTIN_MODELS
    from leapctl.models import SUPPORTED_MODEL_TYPES, resolve_model

    local = spec in BUILTIN_MODELS or Path(spec).expanduser().exists()
    hub_id = not local and spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
    try:  # a hub id: its config.json only, not the weights that resolve_model would fetch
        config = AutoConfig.from_pretrained(spec if hub_id else resolve_model(spec))
    except LeapctlError:
        raise
    except Exception as exc:  # transformers and the hub client raise many types
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LeapctlError(f"cannot read the config of {spec}: {reason}") from None
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise LeapctlError(f"unsupported architecture {config.model_type!r} in {spec} "
                           f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return config


def device_memory(config: LearnConfig, device_type: str, world: int) -> tuple[int, str]:
    """(bytes one process may use, where the number comes from): --device-memory-gb, else the GPU's
    memory (80 GB when planning for a GPU this machine lacks), else the available RAM shared by the
    processes of this machine."""
    if config.device_memory_gb:
        return int(config.device_memory_gb * GB), "--device-memory-gb"
    if device_type == "cuda":
        if torch.cuda.is_available():
            index = torch.cuda.current_device()
            return torch.cuda.get_device_properties(index).total_memory, f"cuda:{index}"
        return int(PLANNED_GPU_GB * GB), f"an {PLANNED_GPU_GB:.0f} GB GPU"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return available_ram() // max(local, 1), f"available RAM / {local}" if local > 1 else "available RAM"


def available_ram() -> int:
    """MemAvailable from /proc/meminfo (Linux); elsewhere the physical memory."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def planned_device_type(config: LearnConfig) -> str:
    """The device type a run of `config` uses: `--plan` plans for a GPU unless --device cpu; a real run
    for the device it resolves."""
    if config.plan:
        return "cpu" if config.device == "cpu" else "cuda"
    from leapctl.compute import resolve_device

    return resolve_device(config.device).type
