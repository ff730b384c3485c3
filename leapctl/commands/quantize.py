"""`leapctl quantize RUN --out DIR`: the kept weights of a run folder on a 4-bit grid, into a new run folder.
From Python: `run(QuantizeConfig(...))` returns the report; `leapctl.quantize.quantize_model` does the same
job on a model in memory."""

import dataclasses
from pathlib import Path

import typer

from leapctl.quantize.config import DEFAULT_CALIB, QuantizeConfig

NAME = "quantize"
HELP = ("Quantize the kept weights of a pruned RUN to 4 bits (codes and a scale per group) and write a run "
        "folder of the dequantized model, ready for export --format bitmap-q4.")
Config = QuantizeConfig
TUNE_PLOT = "tune_kl.png"


def run(config: QuantizeConfig) -> dict:
    """Read a run folder, quantize its kept weights (`quantize_model`) and write a new run folder
    atomically; returns the report. Every bad setting fails before the model loads."""
    import torch

    from leapctl.errors import LeapctlError
    from leapctl.grid import check_group_size
    from leapctl.learn.plots import plot_curve
    from leapctl.masks import MaskSet
    from leapctl.models import load_model, resolve_model
    from leapctl.outdir import atomic_output_dir, check_output_dir
    from leapctl.quantize import quantize_model, tuning_teacher
    from leapctl.runs import read_run, save_run

    config.validate()
    source = read_run(config.run)
    config = dataclasses.replace(config, calib=config.calib or source.calibration_source or DEFAULT_CALIB)
    inputs = (config.run, config.calib)
    check_output_dir(Path(config.out), config.overwrite, inputs)
    if source.scales is not None:
        raise LeapctlError(f"{config.run} is already quantized ({source.report.get('quantization', {})})")
    check_group_size(source.masks, config.group_size)
    if config.tune_steps:
        resolve_model(tuning_teacher(config, source.masks))  # a missing teacher fails here, not minutes later
    model, tokenizer = load_model(str(source.path), dtype=torch.float32)
    done = quantize_model(model, tokenizer, source.masks, config)
    report = {"command": "quantize", "source_run": str(source.path),
              "source": {k: source.report.get(k) for k in ("command", "method", "target_sparsity")},
              "quantization": done.quantization, "calibration": done.calibration, "tuning": done.tuning,
              "device": config.device, "quantize_seconds": round(done.seconds, 3)}
    mask_set = MaskSet(masks=source.masks.masks, model=source.masks.model,
                       extra={**source.masks.extra, "quantized": config.method})
    with atomic_output_dir(Path(config.out), config.overwrite, inputs) as tmp:
        saved = save_run(tmp, model, tokenizer, mask_set, report, scales=done.scales, zeros=done.zeros)
        if done.tuning is not None:
            plot_curve(done.tuning["kl"], "tuning step", "KL(dense || quantized)", "scale tuning",
                       tmp / TUNE_PLOT)
        return saved


def main(config: QuantizeConfig) -> int:
    report = run(config)
    q = report["quantization"]
    layers = len(report["achieved_sparsity"]["per_layer"])
    head = f", lm_head {q['lm_head_bits']} bits" if q["lm_head_bits"] != 16 else ""
    typer.echo(f"{q['method']}: {layers} pruned layers quantized to {q['bits']} bits (group "
               f"{q['group_size']}, {q['grid']} grid){head} in {report['quantize_seconds']:.1f}s -> "
               f"{config.out}")
    return 0
