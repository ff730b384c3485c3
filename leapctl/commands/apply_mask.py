"""`leapctl apply-mask MODEL MASKS --out DIR`: a pruned checkpoint from a dense model and a mask file."""

from pathlib import Path

import typer

from leapctl.cli import app


@app.command("apply-mask")
def apply_mask(
    model: str = typer.Argument(..., help="Dense model: local Hugging Face folder, hub id or built-in name."),
    masks: Path = typer.Argument(..., help="A run folder from prune/learn, or its mask file."),
    out: Path = typer.Option(..., "--out", help="Output folder: checkpoint with zeros, masks, report.json."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it exists and is not empty."),
) -> None:
    """Zero the weights that MASKS prunes in MODEL and write the result as a run folder."""
    from leapctl.runs import apply_mask_run

    report = apply_mask_run(model, masks, out, overwrite)
    sparsity = report["achieved_sparsity"]
    typer.echo(f"wrote {out}: {len(sparsity['per_layer'])} masked weights, "
               f"global sparsity {sparsity['global']:.4f}")
