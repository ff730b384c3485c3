"""Every setting of `leapctl recover`, declared once; the CLI is generated from it."""

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from leapctl.compute import DEVICE_HELP
from leapctl.errors import LeapctlError
from leapctl.settings import setting

LR, GRID_LR = 2e-4, 2e-3  # 16-bit values; latents on the 4-bit grid (bench/results/compress)
DEFAULT_CALIB = "wiki-summaries"  # for a run whose masks used no text (magnitude pruning)
# Settings that change neither the batches nor the arithmetic: a resume may change them.
NOT_IN_FINGERPRINT = ("out", "overwrite", "resume", "checkpoint_every", "progress", "gradient_checkpointing",
                      "device")


def recover_state_dir(out: Path) -> Path:
    """Where checkpoints live until the run folder OUT is written: beside it."""
    return out.with_name(f"{out.name}.recover-state")


@dataclass
class RecoverConfig:
    run: str = setting(help="A run folder from prune, learn or apply-mask (the pruned model and its masks).",
                       argument=True, metavar="RUN")
    out: Path = setting(help="Output run folder: the same masks, the kept weights trained by distillation "
                             "from the dense model.")
    steps: int = setting(200, "Optimizer steps (each of --batch-size windows of --seq-len tokens).")
    batch_size: int = setting(4, "Windows per step.")
    seq_len: int = setting(256, "Tokens per window.")
    lr: float | None = setting(None, f"Peak AdamW learning rate of the kept weights (5% warm-up, cosine to "
                                      f"0; default {LR:g}, on a quantized run's 4-bit grid {GRID_LR:g}: "
                                      f"there {LR:g} moved 2 of 106M codes in 49 steps on SmolLM2).")
    hidden_weight: float = setting(0.0, "Weight of the per-layer hidden-state loss beside the logits' KL "
                                        "(SquareHead: each decoder block's output against the dense model's, "
                                        "mean squared error over the dense output's mean square, averaged "
                                        "over blocks); 0: the logits' KL alone.")
    teacher: str = setting("", "Dense model to distil from (default: the model the run was pruned from, as "
                               "its masks name it).", metavar="MODEL")
    calib: str = setting("", "Training text: file, folder, .jsonl, saved dataset, wiki-summaries or "
                             "generated (default: the text the run's masks were calibrated or learned on, "
                             f"{DEFAULT_CALIB} when they used none).")
    text_field: str = setting("text", "Text field of JSONL or dataset sources.")
    seed: int = setting(0, "Seed of the batches drawn from the text.")
    autocast: bool | None = setting(None, "bf16 autocast of the matmuls (default: where the device "
                                          "multiplies bf16 in hardware: CUDA, or a CPU with AVX512-BF16 or "
                                          "AMX; master weights, Adam state and the losses stay fp32).")
    gradient_checkpointing: bool | None = setting(None, "Recompute each decoder block in the backward "
                                                        "instead of holding its activations (default: on "
                                                        "CUDA, where models are large; off on a CPU).")
    device: str = setting("auto", f"Where to train: {DEVICE_HELP}.")
    checkpoint_every: int = setting(50, "Write a resumable checkpoint every N steps into OUT.recover-state "
                                        "(0: only when stopped by a signal).")
    resume: bool = setting(False, "Continue from the checkpoint in OUT.recover-state (same settings).",
                           flag="--resume")
    overwrite: bool = setting(False, "Replace a non-empty output folder (and a stale checkpoint).",
                              flag="--overwrite")
    progress: bool = setting(True, "Show a progress bar.")

    def validate(self) -> None:
        """One clear error for settings that cannot work, before any model is loaded."""
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 2:
            raise LeapctlError("--steps and --batch-size must be >= 1 and --seq-len >= 2")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise LeapctlError(f"--lr must be a positive number, got {self.lr}")
        if not (math.isfinite(self.hidden_weight) and self.hidden_weight >= 0):
            raise LeapctlError(f"--hidden-weight must be >= 0, got {self.hidden_weight}")
        if self.checkpoint_every < 0:
            raise LeapctlError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.resume and self.overwrite:
            raise LeapctlError("--resume and --overwrite contradict each other: choose one")

    def state_dir(self) -> Path:
        return recover_state_dir(Path(self.out))

    def learning_rate(self, on_grid: bool) -> float:
        return self.lr if self.lr is not None else GRID_LR if on_grid else LR

    def fingerprint(self, autocast: bool) -> dict:
        """What a checkpoint must agree on to be resumed: every setting that changes the numbers."""
        values = {k: v for k, v in asdict(self).items() if k not in NOT_IN_FINGERPRINT}
        return {**{k: str(v) if isinstance(v, Path) else v for k, v in values.items()}, "autocast": autocast}
