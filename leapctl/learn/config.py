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
  better without it. Distillation from the dense model (`distill` 1.0: KL to the same model's logits with
  the masks off) and a schedule that stops at alpha 100 / tau 1 instead of 350 / 0.05 (the mask stays soft
  enough to learn until the end; the hard mask is taken from the logits anyway): on stories260K at 50%,
  200 steps x 8 x 128, ppl 5.74 -> 4.95, and at 60% 7.95 -> 6.39. Distillation costs one more forward
  per micro-batch.
- `paper`: the paper's settings (and the authors' code's where the paper is silent): +-3 logits, lr 1e-2,
  the decaying magnitude term with lambda2 = 10. For reproducing the paper at its budget (2000 steps of
  ~1M tokens); in short runs its logits do not move.
Both presets use lambda1 = 7, AdamW beta2 0.95 without weight decay, 5 warm-up steps then cosine, gradients
clipped at norm 1.0 (the authors' code). Any explicit setting overrides its preset."""

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from leapctl.errors import LeapctlError

INIT_MODES = ("wanda", "wanda-small", "random")
HARD_MASK_MODES = ("global", "per-layer", "positive")
LOGITS_DTYPES = ("float32", "bfloat16")
PRESETS = ("auto", "paper")
# What each preset puts into the settings left at None ("auto" for lr is the rule above).
PRESET_VALUES = {
    "auto": dict(init_scale=0.5, lr="auto", magnitude_term=False, distill=1.0, alpha_end=100.0, tau_end=1.0,
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
)


def auto_lr(steps: int) -> float:
    """The `auto` preset's learning rate for a run of `steps` optimizer steps (see the module docstring)."""
    return 0.4 / math.sqrt(steps)


@dataclass
class LearnConfig:
    model: str
    out: Path | None = None  # the run folder learn writes; None: leap_masks in memory, no files
    sparsity: float = 0.5
    calib: str = "wiki-summaries"
    nsamples: int = 128  # calibration windows for the Wanda initialisation
    calib_tokens: int = 0  # cap on the training corpus in tokens (0: whole source)
    steps: int = 100
    batch_size: int = 8  # global, in sequences, per optimizer step
    micro_batch_size: int = 0  # per forward on one process; 0 means the whole per-process batch
    seq_len: int = 256
    preset: str = "auto"  # fills the settings left None: init_scale, lr, magnitude_term, distill, the
    # temperature schedule's ends (alpha_end, tau_end) and reconstruct
    lr: float | None = None  # peak AdamW learning rate of the logits
    warmup_steps: int = 5
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.0
    alpha_start: float = 25.0
    alpha_end: float | None = None  # alpha at the last step (default: preset)
    tau_start: float = 4.0
    tau_end: float | None = None  # tau at the last step (default: preset)
    fixed_alpha: bool = False
    fixed_tau: bool = False
    lambda1: float = 7.0
    lambda2: float = 10.0
    magnitude_term: bool | None = None  # the decaying -lambda2 * kept-norm ratio term
    max_grad_norm: float = 1.0  # clip the logits' gradient norm (the authors' code: 1.0); 0 turns it off
    distill: float | None = None  # weight d of KL(dense || masked) on the vocabulary; the LM loss gets 1 - d
    reconstruct: bool | None = None  # refit the kept weights by least squares after the hard mask
    init: str = "wanda"
    init_scale: float | None = None  # s of the +-s Wanda initialisation
    init_masks: Path | None = None  # a mask file to start from (a prune run's) instead of computing Wanda
    hard_mask: str = "global"
    logits_dtype: str = "float32"
    autocast: bool | None = None  # bf16 autocast; None: on CUDA, off on CPU (where only AMX makes it pay)
    gradient_checkpointing: bool = True
    include: str | None = None
    exclude: str | None = None
    seed: int = 0
    checkpoint_every: int = 50
    checkpoint_dir: Path | None = None
    resume: bool = False
    overwrite: bool = False
    keep_checkpoint: bool = False
    save_logits: bool = False  # also write the trained logits (mask_logits.safetensors) into the run folder
    fsdp: bool = False
    device: str = "auto"
    progress: bool = True

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
        return Path(self.out).with_name(Path(self.out).name + ".learn-state")

    def resolved(self) -> "LearnConfig":
        """A copy with every setting the preset fills made explicit (explicit settings win)."""
        if self.preset not in PRESETS:
            raise LeapctlError(f"--preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        values = {}
        for name, value in PRESET_VALUES[self.preset].items():
            if getattr(self, name) is None:
                values[name] = auto_lr(max(self.steps, 1)) if value == "auto" else value
        return replace(self, **values)

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
        if not 0.0 < self.sparsity < 1.0:
            raise LeapctlError(f"--sparsity must be in (0, 1), got {self.sparsity}")
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
        if self.lr is not None and self.lr <= 0:
            raise LeapctlError(f"--lr must be positive, got {self.lr}")
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
            if not Path(self.init_masks).is_file():
                raise LeapctlError(f"--init-masks {self.init_masks} does not exist")
        if self.hard_mask not in HARD_MASK_MODES:
            raise LeapctlError(
                f"--hard-mask must be one of {', '.join(HARD_MASK_MODES)}, got {self.hard_mask!r}"
            )
        if self.logits_dtype not in LOGITS_DTYPES:
            raise LeapctlError(f"--logits-dtype must be one of {', '.join(LOGITS_DTYPES)}")
        if self.checkpoint_every < 0:
            raise LeapctlError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.nsamples < 1:
            raise LeapctlError(f"--nsamples must be at least 1, got {self.nsamples}")
