"""`leapctl apply-mask MODEL MASKS --out DIR`: a pruned checkpoint from a dense model and a mask file."""

from dataclasses import dataclass
from pathlib import Path

import typer

from leapctl.settings import setting

NAME = "apply-mask"
HELP = "Zero the weights that MASKS prunes in MODEL and write the result as a run folder."


@dataclass
class ApplyMaskConfig:
    model: str = setting(help="Dense model: local Hugging Face folder, hub id or built-in name.",
                         argument=True, metavar="MODEL")
    masks: Path = setting(help="A run folder from prune/learn, or its mask file.", argument=True,
                          metavar="MASKS")
    out: Path = setting(help="Output folder: checkpoint with zeros, masks, report.json.")
    overwrite: bool = setting(False, "Replace OUT if it exists and is not empty.", flag="--overwrite")


Config = ApplyMaskConfig


def run(config: ApplyMaskConfig) -> dict:
    """Load MODEL in its checkpoint's own dtype, zero the weights the masks prune and write a run folder
    atomically; returns the report."""
    from leapctl.masks import MaskSet, check_keeps_weights, load_masks
    from leapctl.models import checkpoint_dtype, load_model
    from leapctl.outdir import atomic_output_dir, check_output_dir
    from leapctl.runs import mask_source, save_run

    inputs = (config.model, config.masks)
    check_output_dir(Path(config.out), config.overwrite, inputs)  # fail before the slow part
    masks_path = mask_source(config.masks)
    mask_set = load_masks(masks_path)
    check_keeps_weights(mask_set, masks_path)
    model, tokenizer = load_model(config.model, dtype=checkpoint_dtype(config.model))
    report = {"command": "apply-mask", "masks_file": str(masks_path), "masks_model": mask_set.model,
              "masks_extra": mask_set.extra}
    with atomic_output_dir(Path(config.out), config.overwrite, inputs) as tmp:
        return save_run(tmp, model, tokenizer, MaskSet(masks=mask_set.masks, model=config.model,
                                                       extra=mask_set.extra), report)


def main(config: ApplyMaskConfig) -> int:
    report = run(config)
    sparsity = report["achieved_sparsity"]
    typer.echo(f"wrote {config.out}: {len(sparsity['per_layer'])} masked weights, "
               f"global sparsity {sparsity['global']:.4f}")
    return 0
