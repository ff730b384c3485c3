"""`leapctl prune`: one-shot magnitude, Wanda or SparseGPT pruning into a run folder."""

import re
import time
from pathlib import Path

import typer

from leapctl.cli import app
from leapctl.errors import LeapctlError

DTYPES = ("float32", "bfloat16", "float16")


@app.command()
def prune(
    model: str = typer.Argument(..., help="Local HF folder, hub id, or built-in name (smollm2-135m)."),
    method: str = typer.Option(..., "--method", help="magnitude, wanda or sparsegpt."),
    sparsity: float = typer.Option(..., "--sparsity", help="Fraction of weights zeroed per layer."),
    out: Path = typer.Option(..., "--out", help="Output folder: checkpoint, masks, report."),
    calib: str = typer.Option("wiki-summaries", "--calib",
                              help="Calibration text: file, folder, .jsonl, saved dataset, wiki-summaries or "
                                   "generated. Magnitude ignores it."),
    nsamples: int = typer.Option(128, "--nsamples", help="Calibration sequences."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per calibration sequence."),
    seed: int = typer.Option(0, "--seed", help="Seed of the calibration windows (or generated samples)."),
    text_field: str = typer.Option("text", "--text-field", help="Text field of JSONL or dataset sources."),
    include: str | None = typer.Option(None, "--include", help="Regex: prune only matching linear names."),
    exclude: str | None = typer.Option(None, "--exclude", help="Regex: skip matching linear names."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda: where each block is computed."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    batch_size: int = typer.Option(8, "--batch-size", help="Calibration sequences per block forward."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output folder."),
) -> None:
    """Prune MODEL one-shot and write the pruned checkpoint, its masks and a report to --out."""
    import torch

    from leapctl.data import calibration_batch
    from leapctl.models import load_model
    from leapctl.outdir import atomic_output_dir, check_output_dir
    from leapctl.prune import CALIBRATED, check_method, check_sparsity, prune_model
    from leapctl.runs import save_run

    check_method(method)
    check_sparsity(sparsity)
    if dtype not in DTYPES:
        raise LeapctlError(f"unknown --dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if nsamples < 1 or seq_len < 2 or batch_size < 1:
        raise LeapctlError("--nsamples and --batch-size must be >= 1 and --seq-len >= 2")
    for flag, pattern in (("--include", include), ("--exclude", exclude)):
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise LeapctlError(f"{flag} {pattern!r} is not a valid regular expression: {exc}") from None
    check_output_dir(out, overwrite)

    net, tokenizer = load_model(model, dtype=getattr(torch, dtype))
    calibration = None
    if method in CALIBRATED:
        calib_ids = calibration_batch(calib, tokenizer, nsamples, seq_len, seed, model=net,
                                      text_field=text_field)
        calibration = {"source": calib, "nsamples": nsamples, "seq_len": seq_len, "seed": seed,
                       "tokens": int(calib_ids.numel())}
    else:
        calib_ids = None
    started = time.perf_counter()
    mask_set = prune_model(net, method, sparsity, calib_ids, include=include, exclude=exclude,
                           device=device, batch_size=batch_size)
    seconds = time.perf_counter() - started
    report = {
        "command": "prune",
        "method": method,
        "target_sparsity": sparsity,
        "calibration": calibration,
        "include": include,
        "exclude": exclude,
        "device": device,
        "dtype": dtype,
        "prune_seconds": round(seconds, 3),
    }
    with atomic_output_dir(out, overwrite) as tmp:
        save_run(tmp, net, tokenizer, mask_set, report)
    achieved = mask_set.sparsity()["global"]
    typer.echo(f"{method}: {len(mask_set.masks)} layers pruned to {achieved:.4f} sparsity "
               f"(target {sparsity}) in {seconds:.1f}s -> {out}")
