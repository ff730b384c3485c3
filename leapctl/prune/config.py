"""Every setting of a one-shot pruning run (`leapctl prune`), declared once; the CLI is generated from it."""

import re
from dataclasses import dataclass
from pathlib import Path

from leapctl.compute import DEVICE_HELP, DTYPES
from leapctl.errors import LeapctlError
from leapctl.settings import setting


@dataclass
class PruneConfig:
    model: str = setting(help="Local Hugging Face folder, hub id, or built-in name (smollm2-135m).",
                         argument=True, metavar="MODEL")
    method: str = setting(help="magnitude, wanda or sparsegpt.")
    sparsity: float = setting(help="Fraction of weights zeroed per layer, in (0, 1).")
    out: Path = setting(help="Output run folder: pruned checkpoint, masks, report.json.")
    calib: str = setting("wiki-summaries", "Calibration text: file, folder, .jsonl, saved dataset, "
                                           "wiki-summaries or generated. Magnitude ignores it.")
    nsamples: int = setting(128, "Calibration sequences.")
    seq_len: int = setting(512, "Tokens per calibration sequence.")
    seed: int = setting(0, "Seed of the calibration windows (or generated samples).")
    text_field: str = setting("text", "Text field of JSONL or dataset sources.")
    include: str | None = setting(None, "Regex: prune only matching linear names.")
    exclude: str | None = setting(None, "Regex: skip matching linear names.")
    device: str = setting("auto", f"Where each block is computed: {DEVICE_HELP}.")
    dtype: str = setting("float32", f"Weights' dtype while pruning and in the run folder: "
                                    f"{', '.join(DTYPES)}.")
    batch_size: int = setting(8, "Calibration sequences per block forward.")
    overwrite: bool = setting(False, "Replace a non-empty output folder.", flag="--overwrite")
    progress: bool = setting(True, "Show progress bars.")

    def validate(self) -> None:
        """One clear error for settings that cannot work, before any model is loaded."""
        from leapctl.prune import check_method, check_sparsity

        check_method(self.method)
        check_sparsity(self.sparsity)
        if self.dtype not in DTYPES:
            raise LeapctlError(f"unknown --dtype {self.dtype!r} (choose from {', '.join(DTYPES)})")
        if self.nsamples < 1 or self.seq_len < 2 or self.batch_size < 1:
            raise LeapctlError("--nsamples and --batch-size must be >= 1 and --seq-len >= 2")
        for flag, pattern in (("--include", self.include), ("--exclude", self.exclude)):
            if pattern is not None:
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise LeapctlError(f"{flag} {pattern!r} is not a valid regular expression: "
                                       f"{exc}") from None
