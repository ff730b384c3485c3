"""Every setting of a LEAP run, checked once before anything is loaded, and the presets that fill the
settings a user leaves open.

Presets (`--preset`):
- `auto` (default): learns from step 1 at any budget. Logits start at +-0.5 on the Wanda mask, where the
  sigmoid's argument alpha*P/tau is 25*0.5/4 = 3.1 (M = 0.96 / 0.04, live gradients; the paper's +-3 puts it
  at 18.75, where dM/dP is 4.5e-8 and nothing moves). The learning rate follows the number of steps T:
  `lr = 0.4 / sqrt(T)`. Adam moves a logit whose gradient is mostly noise by about lr a step in a random
  direction, ~lr * sqrt(T) over the run, and one with a consistent gradient by ~lr * T / 2 (cosine): the
  drift (0.4) stays within the 0.5 margin of the start while a consistent signal covers it 0.4 * sqrt(T)
  times (6 at 200 steps). T = 50, 200, 2000 give 0.057, 0.028, 0.0089 (the paper's 1e-2 at its 2000 steps).
  Under ~25 steps nothing helps: alpha/tau passes 25 within the first fifth of the run, and logits of +-0.5
  saturate before they can cross. No magnitude term: it pulls towards magnitude pruning and measured no
  better without it. Half language modelling, half distillation from the dense model (`distill` 0.5: KL
  to the same model's logits with the masks off) and a schedule that stops at alpha 100 / tau 1 instead of
  350 / 0.05 (the mask stays soft enough to learn until the end; the hard mask is taken from the logits
  anyway): on stories260K at 50%, 200 steps x 8 x 128, ppl 5.79 -> 4.95 with distillation alone. The 0.5
  mix (bench/results/objective_*.md, same budget, same Wanda start): SmolLM2-135M on wiki-summaries, 50%,
  150 x 4 x 256, in domain 19.66 against 20.81 (distillation only) and 20.87 (LM only), WikiText-2 47.37
  against 47.72 and 50.17; stories260K (calibrated on its own samples) 4.99 against 4.94 and 5.36.
  Distillation costs one more forward per micro-batch.
- `paper`: the paper's settings (and the authors' code's where the paper is silent): +-3 logits, lr 1e-2,
  the decaying magnitude term with lambda2 = 10. For reproducing the paper at its budget (2000 steps of
  ~1M tokens); in short runs its logits do not move.
Both presets use lambda1 = 7, AdamW beta2 0.95 without weight decay, 5 warm-up steps then cosine, gradients
clipped at norm 1.0 (the authors' code). Any explicit setting overrides its preset."""

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from leapctl.compute import DEVICE_HELP
from leapctl.errors import LeapctlError
from leapctl.masks import check_sparsity
from leapctl.settings import setting

INIT_MODES = ("wanda", "wanda-small", "random")
HARD_MASK_MODES = ("global", "per-layer", "positive")
LOGITS_DTYPES = ("float32", "bfloat16")
WEIGHT_DTYPES = ("float32", "bfloat16")
PRESETS = ("auto", "paper")
# What each preset puts into the settings left at None ("auto" for lr is the rule above).
PRESET_VALUES = {
    "auto": dict(init_scale=0.5, lr="auto", magnitude_term=False, distill=0.5, alpha_end=100.0, tau_end=1.0,
                 reconstruct=False),
    "paper": dict(init_scale=3.0, lr=1e-2, magnitude_term=True, distill=0.0, alpha_end=350.0, tau_end=0.05,
                  reconstruct=False),
}
# Settings that change neither the windows, the noise nor the arithmetic (only speed, memory, bookkeeping,
# or the order of floating-point sums): a resume may change them.
NOT_IN_FINGERPRINT = (
    "out",
    "overwrite",
    "resume",
    "checkpoint_dir",
    "checkpoint_every",
    "progress",
    "keep_checkpoint",
    "save_logits",
    "fsdp",
    "gradient_checkpointing",
    "device",
    "plan",
    "world_size",
    "device_memory_gb",
    "dist_timeout_s",
)


def learn_state_dir(out: Path) -> Path:
    """Where an unfinished run into OUT keeps its state: beside OUT."""
    return out.with_name(f"{out.name}.learn-state")


def auto_lr(steps: int) -> float:
    """The `auto` preset's learning rate for a run of `steps` optimizer steps (see the module docstring)."""
    return 0.4 / math.sqrt(steps)


@dataclass
class LearnConfig:
    model: str = setting(help="Local Hugging Face folder, hub id, or built-in name (smollm2-135m).",
                         argument=True, metavar="MODEL")
    # None in Python: leap_masks in memory, no files.
    # Required unless --plan: `run` checks it (so `--plan` needs no folder).
    out: Path | None = setting(None, "Output run folder: checkpoint, masks, report, plots (required, except "
                                     "with --plan).")
    sparsity: float = setting(0.5, "Target fraction of zeros over all masked weights.")
    calib: str = setting("wiki-summaries", "Training text: file, folder, .jsonl, saved dataset, "
                                           "wiki-summaries or generated (sampled from the model).")
    nsamples: int = setting(128, "Calibration sequences for the Wanda initialisation and the reconstruction.")
    calib_tokens: int = setting(0, "Training corpus size in tokens (0: whole text source; for generated: "
                                   "one pass of the run, at most 1M).")
    steps: int = setting(100, "Optimizer steps.")
    batch_size: int = setting(8, "Global batch in sequences per optimizer step.")
    micro_batch_size: int = setting(0, "Sequences per forward on one process (0: the whole share).")
    seq_len: int = setting(256, "Tokens per training sequence.")
    preset: str = setting("auto", "auto (learns from step 1 at any budget: +-0.5 logits, lr 0.4/sqrt(steps), "
                                  "LM loss + distillation 0.5, alpha 25->100, tau 4->1) or paper (+-3, lr "
                                  "1e-2, magnitude term, alpha 25->350, tau 4->0.05); explicit options "
                                  "override it.")
    lr: float | None = setting(None, "Peak AdamW learning rate of the logits (default: preset).")
    warmup_steps: int = setting(5, "Linear warm-up before the cosine decay.")
    beta1: float = setting(0.9, "AdamW beta1.")
    beta2: float = setting(0.95, "AdamW beta2.")
    weight_decay: float = setting(0.0, "AdamW weight decay of the logits.")
    weight_lr: float = setting(0.0, "Learn the masked linears' weights with the mask, in the same loop, at "
                                    "this peak AdamW learning rate (same warm-up and cosine, no weight "
                                    "decay; the teacher keeps a frozen dense copy). 0: the weights stay "
                                    "frozen, as in the paper. Needs --dtype float32, no --bits, no "
                                    "--reconstruct.")
    alpha_start: float = setting(25.0, "Logit scale alpha at the first step.")
    alpha_end: float | None = setting(None, "Logit scale alpha at the last step (default: preset).")
    tau_start: float = setting(4.0, "Temperature tau at the first step.")
    tau_end: float | None = setting(None, "Temperature tau at the last step (default: preset).")
    fixed_alpha: bool = setting(False, "Ablation: hold alpha at --alpha-start.", flag="--fixed-alpha")
    fixed_tau: bool = setting(False, "Ablation: hold tau at --tau-start.", flag="--fixed-tau")
    lambda1: float = setting(7.0, "Weight of |global density - target density|.")
    lambda2: float = setting(10.0, "Weight of the (decaying) kept-magnitude ratio.")
    magnitude_term: bool | None = setting(None, "The decaying magnitude term (default: preset; paper: on).",
                                          flag="--magnitude/--no-magnitude")
    max_grad_norm: float = setting(1.0, "Clip the logits' gradient norm (the authors' 1.0), and with "
                                        "--weight-lr the weights' on their own; 0 turns it off.")
    distill: float | None = setting(None, "Weight d of KL(dense || masked) against the same model with the "
                                          "masks off; the LM loss gets 1 - d (default: preset).")
    reconstruct: bool | None = setting(None, "After the hard mask, refit the kept weights by least squares "
                                             "per layer on --nsamples windows (default: preset).")
    bits: int | None = setting(None, "Quantize the frozen weights of the masked linears to this many bits "
                                     "(4, the bitmap-q4 grid, round to nearest) before learning, so that "
                                     "the mask is learned against the weights that will be served.")
    group_size: int = setting(64, "Input columns per scale with --bits (a multiple of 32 dividing the "
                                  "columns of every masked linear).")
    init: str = setting("wanda", "wanda (+-scale), wanda-small (authors' code) or random.")
    init_scale: float | None = setting(None, "s of the +-s Wanda initialisation (default: preset).")
    init_masks: Path | None = setting(None, "Start from these masks (a prune run folder or its mask file), "
                                            "not a fresh Wanda.")
    hard_mask: str = setting("global", "global (exact density, top-k over all layers), per-layer (exact "
                                       "density in each layer) or positive (P > 0).")
    logits_dtype: str = setting("float32", "float32 or bfloat16 logits.")
    dtype: str = setting("float32", "Dtype of the frozen weights: float32 or bfloat16 (half the memory; the "
                                    "matmuls then run in bf16, the soft mask in fp32).")
    autocast: bool | None = setting(None, "bf16 autocast of the matmuls (default: on CUDA, off on CPU; "
                                          "CPUs with AVX512-BF16 or AMX run it faster, CPUs without widen "
                                          "every bf16 matmul to fp32, ~7x slower).")
    gradient_checkpointing: bool = setting(True, "Recompute each decoder block in the backward.")
    include: str | None = setting(None, "Regex: mask only matching linear names.")
    exclude: str | None = setting(None, "Regex: skip matching linear names.")
    seed: int = setting(0, "Seed of data order, noise and initialisation.")
    checkpoint_every: int = setting(50, "Steps between checkpoints (0: never; SIGTERM/SIGINT always "
                                        "checkpoint).")
    checkpoint_dir: Path | None = setting(None, "Where the unfinished run lives (default OUT.learn-state).")
    resume: bool = setting(False, "Continue from the checkpoint.", flag="--resume")
    overwrite: bool = setting(False, "Replace the output folder and any old checkpoint.", flag="--overwrite")
    keep_checkpoint: bool = setting(False, "Keep the checkpoint after success.", flag="--keep-checkpoint")
    save_logits: bool = setting(False, "Also write the trained logits (leapctl/mask_logits.safetensors) into "
                                       "--out.", flag="--save-logits")
    fsdp: bool = setting(False, "Under torchrun: shard with FSDP2 instead of DDP.", flag="--fsdp")
    device: str = setting("auto", f"{DEVICE_HELP}.")
    plan: bool = setting(False, "Only print the memory plan for this configuration (MODEL's config.json is "
                                "enough: built on the meta device), write nothing and exit: 0 when it fits, "
                                "2 when not. For a GPU run unless --device cpu.", flag="--plan")
    world_size: int = setting(0, "Processes the plan is for (0: WORLD_SIZE under torchrun, else 1); a real "
                                 "run takes torchrun's.")
    device_memory_gb: float = setting(0.0, "Memory of one device the plan must fit, in GB (0: detected: the "
                                           "GPU's, 80 when planning for a GPU this machine lacks; on the "
                                           "CPU the available RAM shared by the processes).")
    dist_timeout_s: int = setting(1800, "Timeout of the process group's collectives, and of the other "
                                        "processes' wait while rank 0 tokenises and computes Wanda.")
    progress: bool = setting(True, "Show the progress bar.")
    report_windows: int = setting(32, "At the end, perplexity dense against sparse on this many --seq-len "
                                      "windows of held-apart calibration text and of WikiText-2 (when the "
                                      "shared assets hold it); a text source's tail (at most 2%) is then not "
                                      "trained on. 0: no report, nothing held apart.")

    @property
    def density(self) -> float:
        return 1.0 - self.sparsity

    def state_dir(self) -> Path | None:
        """Where the token stream, the metrics and the checkpoints live while the run is unfinished: beside
        the output folder, not in it, because the output folder only appears (atomically) when the run is
        done. None for an in-memory run (no `out`, no `checkpoint_dir`)."""
        if self.checkpoint_dir:
            return Path(self.checkpoint_dir)
        if self.out is None:
            return None
        return learn_state_dir(Path(self.out))

    def resolved(self) -> "LearnConfig":
        """A copy with every setting the preset fills made explicit (explicit settings win)."""
        if self.preset not in PRESETS:
            raise LeapctlError(f"--preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        values = {}
        for name, value in PRESET_VALUES[self.preset].items():
            if getattr(self, name) is None:
                values[name] = auto_lr(max(self.steps, 1)) if value == "auto" else value
        return replace(self, **values)

    def checked(self, world_size: int = 1) -> "LearnConfig":
        """Resolved (`resolved`) and validated (`validate`): the one call an entry point makes."""
        config = self.resolved()
        config.validate(world_size)
        return config

    def fingerprint(self, autocast: bool | None = None) -> dict:
        """The settings a resumed run must share with the checkpoint: every one that changes the windows, the
        noise or the arithmetic, with the preset's values resolved; `autocast` as the device resolved it."""
        settings = asdict(self.resolved())
        if autocast is not None:
            settings["autocast"] = autocast
        return {k: (str(v) if isinstance(v, Path) else v)
                for k, v in settings.items() if k not in NOT_IN_FINGERPRINT}

    def validate(self, world_size: int = 1) -> None:
        """One clear error for settings that cannot work, before any model is loaded."""
        check_sparsity(self.sparsity)
        if self.steps < 1:
            raise LeapctlError(f"--steps must be at least 1, got {self.steps}")
        if self.seq_len < 2:
            raise LeapctlError(f"--seq-len must be at least 2, got {self.seq_len}")
        if self.batch_size < 1:
            raise LeapctlError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.batch_size % world_size:
            raise LeapctlError(
                f"--batch-size {self.batch_size} is not divisible by the {world_size} processes"
            )
        micro = self.micro_batch_size or self.batch_size // world_size
        if micro < 1 or (self.batch_size // world_size) % micro:
            raise LeapctlError(
                f"--micro-batch-size {micro} must divide the per-process batch "
                f"{self.batch_size // world_size}"
            )
        if self.preset not in PRESETS:
            raise LeapctlError(f"--preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):  # nan passes `<= 0`
            raise LeapctlError(f"--lr must be a positive finite number, got {self.lr}")
        if self.init_scale is not None and self.init_scale <= 0:
            raise LeapctlError(f"--init-scale must be positive, got {self.init_scale}")
        if self.distill is not None and not 0.0 <= self.distill <= 1.0:
            raise LeapctlError(f"--distill must be in [0, 1], got {self.distill}")
        if self.max_grad_norm < 0:
            raise LeapctlError(f"--max-grad-norm must be >= 0 (0: no clipping), got {self.max_grad_norm}")
        if self.warmup_steps < 0:
            raise LeapctlError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        ends = [v for v in (self.alpha_end, self.tau_end) if v is not None]
        if min(self.alpha_start, self.tau_start, *ends) <= 0:
            raise LeapctlError("alpha and tau must be positive")
        if self.init not in INIT_MODES:
            raise LeapctlError(f"--init must be one of {', '.join(INIT_MODES)}, got {self.init!r}")
        if self.init_masks is not None:
            if self.init == "random":
                raise LeapctlError("--init-masks goes with --init wanda or wanda-small, not random")
            if not Path(self.init_masks).exists():
                raise LeapctlError(f"--init-masks {self.init_masks} does not exist")
        if self.hard_mask not in HARD_MASK_MODES:
            raise LeapctlError(
                f"--hard-mask must be one of {', '.join(HARD_MASK_MODES)}, got {self.hard_mask!r}"
            )
        if self.logits_dtype not in LOGITS_DTYPES:
            raise LeapctlError(f"--logits-dtype must be one of {', '.join(LOGITS_DTYPES)}")
        if self.dtype not in WEIGHT_DTYPES:
            raise LeapctlError(f"--dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {self.dtype!r}")
        if self.world_size < 0 or self.device_memory_gb < 0 or self.dist_timeout_s < 1:
            raise LeapctlError("--world-size and --device-memory-gb must be >= 0, --dist-timeout-s >= 1")
        if self.checkpoint_every < 0:
            raise LeapctlError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.nsamples < 1:
            raise LeapctlError(f"--nsamples must be at least 1, got {self.nsamples}")
        if self.report_windows < 0:
            raise LeapctlError(f"--report-windows must be >= 0, got {self.report_windows}")
        if not (math.isfinite(self.weight_lr) and self.weight_lr >= 0):
            raise LeapctlError(f"--weight-lr must be a finite number >= 0, got {self.weight_lr}")
        if self.weight_lr:
            if self.dtype != "float32":
                raise LeapctlError("--weight-lr trains the weights: they need --dtype float32 (bf16 drops "
                                   "updates below 1/256 of a weight)")
            if self.bits is not None:
                raise LeapctlError("--weight-lr would move the weights off the --bits grid: choose one")
            if self.resolved().reconstruct:
                raise LeapctlError("--weight-lr trains the kept weights; --reconstruct would refit them "
                                   "afterwards (pass --no-reconstruct)")
        if self.bits is not None:
            from leapctl.grid import SUPPORTED_BITS

            if self.bits not in SUPPORTED_BITS:
                raise LeapctlError(f"--bits {self.bits} is not supported (supported: "
                                   f"{', '.join(map(str, SUPPORTED_BITS))})")
            if self.group_size <= 0 or self.group_size % 32:
                raise LeapctlError(f"--group-size must be a positive multiple of 32, got {self.group_size}")
            if self.resolved().reconstruct:
                raise LeapctlError("--bits keeps the kept weights on their grid; --reconstruct would move "
                                   "them off it (pass --no-reconstruct)")
