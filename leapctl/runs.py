"""The run folder that `prune` and `learn` write and `eval`, `export` and `apply-mask` read:
a Hugging Face checkpoint of the pruned model (zeros in place, config and tokenizer), `masks.safetensors`
and `report.json`."""

import json
import platform
import time
from pathlib import Path

import torch

from leapctl import __version__
from leapctl.masks import MaskSet, apply_masks, save_masks

MASKS_FILE = "masks.safetensors"
REPORT_FILE = "report.json"


def save_run(out_dir: Path, model: torch.nn.Module, tokenizer, mask_set: MaskSet, report: dict) -> None:
    """Write the masked checkpoint, the masks and the report into `out_dir` (an atomic temp folder)."""
    apply_masks(model, mask_set)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    save_masks(out_dir / MASKS_FILE, mask_set)
    sparsity = mask_set.sparsity()
    full = {
        **report,
        "model": mask_set.model,
        "achieved_sparsity": {"global": sparsity.pop("global"), "per_layer": sparsity},
        "tool": {"name": "leapctl", "version": __version__, "torch": torch.__version__,
                 "python": platform.python_version()},
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (out_dir / REPORT_FILE).write_text(json.dumps(full, indent=2) + "\n")
