"""`leapctl prune MODEL --method magnitude|wanda|sparsegpt --sparsity S --out RUN`: one-shot pruning into
a run folder. From Python: `run(PruneConfig(...))` returns the report; `leapctl.prune.prune_model` prunes
a model in memory."""

import time
from pathlib import Path

import typer

from leapctl.prune.config import PruneConfig

NAME = "prune"
HELP = "Prune MODEL one-shot and write the pruned checkpoint, its masks and a report to --out."
Config = PruneConfig


def run(config: PruneConfig) -> dict:
    """Load the model, calibrate, prune one-shot and write the run folder atomically; returns the report."""
    from leapctl.compute import dtype_from_name
    from leapctl.data import calibration_batch
    from leapctl.models import load_model
    from leapctl.outdir import atomic_output_dir, check_output_dir
    from leapctl.prune import CALIBRATED, prune_model
    from leapctl.runs import save_run

    config.validate()
    inputs = (config.model, config.calib)
    check_output_dir(Path(config.out), config.overwrite, inputs)  # fail before the slow part
    model, tokenizer = load_model(config.model, dtype=dtype_from_name(config.dtype))
    calib_ids, calibration = None, None
    if config.method in CALIBRATED:
        calib_ids = calibration_batch(config.calib, tokenizer, config.nsamples, config.seq_len, config.seed,
                                      model=model, text_field=config.text_field)
        calibration = {"source": config.calib, "nsamples": config.nsamples, "seq_len": config.seq_len,
                       "seed": config.seed, "tokens": int(calib_ids.numel())}
    started = time.perf_counter()
    mask_set = prune_model(model, config.method, config.sparsity, calib_ids, include=config.include,
                           exclude=config.exclude, device=config.device, batch_size=config.batch_size,
                           progress=config.progress)
    seconds = time.perf_counter() - started
    report = {"command": "prune", "method": config.method, "target_sparsity": config.sparsity,
              "calibration": calibration, "include": config.include, "exclude": config.exclude,
              "device": config.device, "dtype": config.dtype, "prune_seconds": round(seconds, 3)}
    with atomic_output_dir(Path(config.out), config.overwrite, inputs) as tmp:
        return save_run(tmp, model, tokenizer, mask_set, report)


def main(config: PruneConfig) -> int:
    report = run(config)
    achieved = report["achieved_sparsity"]["global"]
    typer.echo(f"{config.method}: {len(report['achieved_sparsity']['per_layer'])} layers pruned to "
               f"{achieved:.4f} sparsity (target {config.sparsity}) in {report['prune_seconds']:.1f}s "
               f"-> {config.out}")
    return 0
