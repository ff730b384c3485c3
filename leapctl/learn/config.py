"""Every setting of a LEAP run, with the defaults of the paper (and the authors' code where the paper
is silent), checked once before anything is loaded."""

from dataclasses import asdict, dataclass, field
from pathlib import Path

from leapctl.errors import LeapctlError

INIT_MODES = ("wanda", "wanda-small", "random")
HARD_MASK_MODES = ("global", "per-layer", "positive")
LOGITS_DTYPES = ("float32", "bfloat16")
# Settings that do not change the result (only speed, memory or bookkeeping): a resume may change them.
NOT_IN_FINGERPRINT = (
    "out",
    "overwrite",
    "resume",
    "checkpoint_dir",
    "checkpoint_every",
    "progress",
    "micro_batch_size",
    "keep_checkpoint",
    "save_logits",
    "fsdp",
    "gradient_checkpointing",
    "device",
)


@dataclass
class LearnConfig:
    model: str
    out: Path
    sparsity: float = 0.5
    calib: str = "wiki-summaries"
    nsamples: int = 128  # calibration windows for the Wanda initialisation
    calib_tokens: int = 0  # cap on the training corpus in tokens (0: whole source)
    steps: int = 100
    batch_size: int = 8  # global, in sequences, per optimizer step
    micro_batch_size: int = 0  # per forward on one process; 0 means the whole per-process batch
    seq_len: int = 256
    lr: float = 1e-2
    warmup_steps: int = 5
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.0
    alpha_start: float = 25.0
    alpha_end: float = 350.0
    tau_start: float = 4.0
    tau_end: float = 0.05
    fixed_alpha: bool = False
    fixed_tau: bool = False
    lambda1: float = 7.0
    lambda2: float = 10.0
    magnitude_term: bool = True
    init: str = "wanda"
    init_scale: float = 3.0
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
    extra: dict = field(default_factory=dict)

    @property
    def density(self) -> float:
        return 1.0 - self.sparsity

    def state_dir(self) -> Path:
        """Where checkpoints live while the run is unfinished: beside the output folder, not in it,
        because the output folder only appears (atomically) when the run is done."""
        return (
            Path(self.checkpoint_dir)
            if self.checkpoint_dir
            else Path(self.out).with_name(Path(self.out).name + ".learn-state")
        )

    def fingerprint(self) -> dict:
        """The settings a resumed run must share with the checkpoint."""
        return {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in asdict(self).items()
            if k not in NOT_IN_FINGERPRINT
        }

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
        if self.lr <= 0:
            raise LeapctlError(f"--lr must be positive, got {self.lr}")
        if self.warmup_steps < 0:
            raise LeapctlError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if min(self.alpha_start, self.alpha_end, self.tau_start, self.tau_end) <= 0:
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
        if self.checkpoint_every < 0:
            raise LeapctlError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.nsamples < 1:
            raise LeapctlError(f"--nsamples must be at least 1, got {self.nsamples}")
