"""The run folder: what `prune`, `learn` and `apply-mask` write and what `eval`, `export`, `apply-mask`
and `learn --init-masks` read. This module is its one owner: layout, writing, reading and the report.

    RUN/config.json, model*.safetensors, tokenizer   the pruned model, zeros in place
    RUN/report.json                                   how it was made, achieved sparsity
    RUN/leapctl/masks.safetensors                     packed keep-masks (leapctl.masks)
    RUN/leapctl/mask_logits.safetensors               learn --save-logits
    RUN/leapctl/scales.safetensors                    quantize, learn --bits: fp16 scales of the 4-bit
                                                      grid the kept weights sit on (sparse_formats.bitmap_q4)
    RUN/leapctl/zeros.safetensors                     quantize --grid asymmetric: its uint8 zero points

The top level is an ordinary Hugging Face checkpoint that stock transformers and vLLM load as it is. The
mask files sit one folder down because vLLM loads every `*.safetensors` at the top of a folder that has no
index. Folders written before this layout (`RUN/masks.safetensors`) are still read."""

import json
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from leapctl import __version__
from leapctl.errors import LeapctlError
from leapctl.masks import MaskSet, apply_masks, load_masks, save_masks

LEAPCTL_DIR = "leapctl"
MASKS_FILE = f"{LEAPCTL_DIR}/masks.safetensors"
LOGITS_FILE = f"{LEAPCTL_DIR}/mask_logits.safetensors"
SCALES_FILE = f"{LEAPCTL_DIR}/scales.safetensors"
ZEROS_FILE = f"{LEAPCTL_DIR}/zeros.safetensors"
LEGACY_MASKS_FILE = "masks.safetensors"
REPORT_FILE = "report.json"


@dataclass
class Run:
    """A run folder as read back (or a model with a mask file): the model as named, its local folder,
    the masks and the report (empty when the folder has none)."""

    spec: str
    path: Path
    masks_file: Path
    masks: MaskSet
    report: dict
    scales: dict[str, torch.Tensor] | None = None  # per weight name, when the kept weights are quantized
    zeros: dict[str, torch.Tensor] | None = None  # per weight name, on the asymmetric 4-bit grid

    @property
    def quantization(self) -> dict | None:
        """The report's quantization entry (bits, group size, method) of a quantized run, else None."""
        return self.report.get("quantization") if self.scales is not None else None

    @property
    def calibration_source(self) -> str | None:
        """The text the masks were calibrated or learned on, as the report names it (prune: its calibration
        entry; learn: its settings), None when they used none (magnitude) or the folder has no report."""
        calibration = self.report.get("calibration")
        source = calibration.get("source") if isinstance(calibration, dict) else None
        if isinstance(source, str) and source:
            return source
        settings = self.report.get("settings")
        calib = settings.get("calib") if isinstance(settings, dict) else None
        return calib if isinstance(calib, str) and calib else None


def masks_file(run_dir: Path) -> Path | None:
    """The mask file of a run folder (this layout or the older one), None when it has none."""
    for relative in (MASKS_FILE, LEGACY_MASKS_FILE):
        if (Path(run_dir) / relative).is_file():
            return Path(run_dir) / relative
    return None


def mask_source(path: Path) -> Path:
    """A mask file given as the file itself or as the run folder that holds it."""
    path = Path(path)
    if path.is_dir():
        found = masks_file(path)
        if found is None:
            raise LeapctlError(f"{path} is not a run folder from prune or learn (no {MASKS_FILE})")
        return found
    if not path.is_file():
        raise LeapctlError(f"mask file {path} does not exist")
    return path


def read_run(spec: str | Path, masks: Path | None = None) -> Run:
    """A run folder (local, or any MODEL spec that resolves to one), or a model plus `masks` (a mask file
    or a run folder whose masks to use); one clear error when there are no masks."""
    from leapctl.models import resolve_model

    path = resolve_model(str(spec)).resolve()
    found = mask_source(masks) if masks is not None else masks_file(path)
    if found is None:
        raise LeapctlError(f"{spec} is not a run folder from prune or learn (no {MASKS_FILE}); "
                           f"pass its masks with --masks FILE")
    scales_path = path / SCALES_FILE
    scales = _tensors(scales_path) if masks is None and scales_path.is_file() else None
    zeros_path = path / ZEROS_FILE
    zeros = _tensors(zeros_path) if scales is not None and zeros_path.is_file() else None
    return Run(spec=str(spec), path=path, masks_file=found.resolve(), masks=load_masks(found),
               report=read_report(path), scales=scales, zeros=zeros)


def read_report(run_dir: Path) -> dict:
    """The run's report.json ({} when it has none); one line when it is not a JSON object."""
    path = Path(run_dir) / REPORT_FILE
    if not path.is_file():
        return {}
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise LeapctlError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(report, dict):
        raise LeapctlError(f"{path} is not a run report (a JSON object), it holds a {type(report).__name__}")
    return report


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    """A run's scales or zero points, refused in one line when the file is damaged."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise LeapctlError(f"{path} is not a readable safetensors file: {exc}") from None


def save_run(out_dir: Path, model: torch.nn.Module, tokenizer, mask_set: MaskSet, report: dict,
             scales: dict[str, torch.Tensor] | None = None,
             zeros: dict[str, torch.Tensor] | None = None) -> dict:
    """Write the masked checkpoint, the masks, the quantization scales and zero points if any and the
    report into `out_dir` (an atomic temp folder); returns the report as written."""
    apply_masks(model, mask_set)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / LEAPCTL_DIR).mkdir(exist_ok=True)
    save_masks(out_dir / MASKS_FILE, mask_set)
    if scales is not None:
        save_file({name: scale.contiguous() for name, scale in scales.items()}, str(out_dir / SCALES_FILE))
    if zeros:
        save_file({name: zero.contiguous() for name, zero in zeros.items()}, str(out_dir / ZEROS_FILE))
    full = run_report(mask_set, report)
    (out_dir / REPORT_FILE).write_text(json.dumps(full, indent=2) + "\n")
    return full


def run_report(mask_set: MaskSet, report: dict) -> dict:
    """`report` completed with what every run records: model, achieved sparsity, tool versions, time."""
    sparsity = mask_set.sparsity()
    return {
        **report,
        "model": mask_set.model,
        "achieved_sparsity": {"global": sparsity.pop("global"), "per_layer": sparsity},
        "tool": {"name": "leapctl", "version": __version__, "torch": torch.__version__,
                 "python": platform.python_version()},
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
