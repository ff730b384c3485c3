"""`leapctl export`: a pruned run (or model + masks) as a sparse serving checkpoint, compressed-tensors
or ONNX."""

from pathlib import Path

import typer

from leapctl.cli import app


@app.command()
def export(
    source: str = typer.Argument(..., help="Run folder from prune/learn, or a model folder with --masks."),
    fmt: str = typer.Option(..., "--format",
                            help="bitmap or csr (serving checkpoints), tiled-csl, tiled-bitmap, "
                                 "compressed-tensors or onnx."),
    out: Path = typer.Option(..., "--out", help="Output folder (written atomically)."),
    masks: Path | None = typer.Option(None, "--masks",
                                      help="Mask file or run folder; default: the masks of SOURCE."),
    dtype: str | None = typer.Option(None, "--dtype",
                                     help="Cast weights first: float32, float16 or bfloat16. Default: keep "
                                          "the source dtype, or the one the format needs (tiled-csl: "
                                          "float16)."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size",
                                       help="Largest safetensors shard, e.g. 2GB."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output folder."),
) -> None:
    """Export SOURCE in --format to --out, with manifest.json (checksums, per-layer density and sizes)."""
    from rich.console import Console

    from leapctl.export import export as run_export
    from leapctl.outdir import check_output_dir

    check_output_dir(out, overwrite, (source, masks))
    console = Console(stderr=True)
    with console.status(f"exporting {source} as {fmt}"):
        manifest = run_export(source, fmt, out, masks=masks, overwrite=overwrite,
                              max_shard_size=max_shard_size, dtype=dtype, notify=console.print)
    totals = manifest["totals"]
    console.print(f"wrote {out}: {fmt}, {len(manifest['layers'])} pruned layers at sparsity "
                  f"{manifest['sparsity']:.1%}; pruned layers {totals['pruned_sparse_bytes'] / 1e6:.2f} MB "
                  f"(dense {totals['pruned_dense_bytes'] / 1e6:.2f} MB); "
                  f"files {totals['files_bytes'] / 1e6:.2f} MB")
