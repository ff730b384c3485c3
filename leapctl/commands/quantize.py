"""`leapctl quantize RUN --out DIR`: the kept weights of a run folder on a 4-bit grid, into a new run folder.
From Python: `run(QuantizeConfig(...))` returns the report; `leapctl.quantize.quantize_model` works in
memory."""

import time
from pathlib import Path

import typer

from leapctl.quantize.config import DEFAULT_CALIB, QuantizeConfig

NAME = "quantize"
HELP = ("Quantize the kept weights of a pruned RUN to 4 bits (codes and a scale per group) and write a run "
        "folder of the dequantized model, ready for export --format bitmap-q4.")
Config = QuantizeConfig


def run(config: QuantizeConfig) -> dict:
    """Read a run folder, quantize its kept weights and write a new run folder
    atomically; returns the report. Every bad setting fails before the model loads."""
    import torch

    from leapctl.data import calibration_batch
    from leapctl.errors import LeapctlError
    from leapctl.learn.plots import plot_curve
    from leapctl.masks import MaskSet
    from leapctl.models import load_model, resolve_model
    from leapctl.outdir import atomic_output_dir, check_output_dir
    from leapctl.quantize import (
        LM_HEAD,
        check_group_size,
        quantization_entry,
        quantize_lm_head,
        quantize_model,
    )
    from leapctl.runs import read_run, save_run

    config.validate()
    source = read_run(config.run)
    calib = config.calib or source.calibration_source or DEFAULT_CALIB
    inputs = (config.run, calib)
    check_output_dir(Path(config.out), config.overwrite, inputs)
    if source.scales is not None:
        raise LeapctlError(f"{config.run} is already quantized ({source.report.get('quantization', {})})")
    check_group_size(source.masks, config.group_size)
    teacher = None
    if config.tune_steps:
        teacher = config.teacher or source.masks.model
        if not teacher:
            raise LeapctlError(f"{config.run}'s masks name no model to tune against: pass --teacher MODEL "
                               f"(the dense model) or --tune-steps 0")
        resolve_model(teacher)  # a missing teacher fails here, before the quantization's minutes
    model, tokenizer = load_model(str(source.path), dtype=torch.float32)
    calib_ids, calibration = None, None
    if config.method == "gptq":
        calib_ids = calibration_batch(calib, tokenizer, config.nsamples, config.seq_len, config.seed,
                                      model=model, text_field=config.text_field)
        calibration = {"source": calib, "nsamples": config.nsamples, "seq_len": config.seq_len,
                       "seed": config.seed, "tokens": int(calib_ids.numel()), "act_order": config.act_order}
    started = time.perf_counter()
    options = {} if config.method == "rtn" else dict(device=config.device, batch_size=config.batch_size,
                                                       progress=config.progress, act_order=config.act_order)
    scales, zeros = quantize_model(model, source.masks, config.method, config.group_size, calib_ids,
                                   config.grid, **options)
    if config.lm_head_bits == 4:  # before tuning, which then learns its scales with the rest
        scales[LM_HEAD], head_zeros = quantize_lm_head(model, 4, config.group_size, config.grid)
        if head_zeros is not None:
            zeros[LM_HEAD] = head_zeros
    quantize_seconds = time.perf_counter() - started
    tuning = None
    if config.tune_steps:
        scales, tuning = tune(model, tokenizer, teacher, scales, calib, config)
    if config.lm_head_bits == 8:  # after tuning: its 8-bit grid has no scales worth learning
        scales[LM_HEAD], _ = quantize_lm_head(model, 8, config.group_size)
    report = {"command": "quantize", "source_run": str(source.path),
              "source": {k: source.report.get(k) for k in ("command", "method", "target_sparsity")},
              "quantization": quantization_entry(config.bits, config.group_size, config.method,
                                                 config.lm_head_bits, config.grid),
              "calibration": calibration, "tuning": tuning, "device": config.device,
              "quantize_seconds": round(quantize_seconds, 3)}
    mask_set = MaskSet(masks=source.masks.masks, model=source.masks.model,
                       extra={**source.masks.extra, "quantized": config.method})
    with atomic_output_dir(Path(config.out), config.overwrite, inputs) as tmp:
        saved = save_run(tmp, model, tokenizer, mask_set, report, scales=scales, zeros=zeros)
        if tuning is not None:
            plot_curve(tuning["kl"], "tuning step", "KL(dense || quantized)", "scale tuning", tmp / TUNE_PLOT)
        return saved


TUNE_PLOT = "tune_kl.png"


def tune(model, tokenizer, teacher_spec: str, scales: dict, calib: str,
         config: QuantizeConfig) -> tuple[dict, dict]:
    """The scales after end-to-end tuning against the dense model `teacher_spec` on `calib`'s text, and the
    report's entry."""
    import torch

    from leapctl.compute import native_bf16, resolve_device
    from leapctl.data import training_windows
    from leapctl.models import load_model
    from leapctl.quantize.tune import tune_scales

    started = time.perf_counter()
    device = resolve_device(config.device)
    autocast = config.autocast if config.autocast is not None else native_bf16(device)
    teacher, _ = load_model(teacher_spec, dtype=torch.float32)
    windows = training_windows(calib, tokenizer, teacher, config.tune_steps, config.batch_size,
                             config.seq_len, config.seed, config.text_field)
    result = tune_scales(model.to(device), teacher.to(device), scales, windows, config.tune_steps,
                         config.tune_lr, config.batch_size, config.seed, config.progress, autocast,
                         config.gradient_checkpointing)
    model.cpu()
    last = result.kl[-10:]
    entry = {"source": calib, "steps": config.tune_steps, "lr": config.tune_lr,
             "batch_size": config.batch_size, "autocast": autocast,
             "gradient_checkpointing": config.gradient_checkpointing, "windows": int(windows.shape[0]),
             "teacher": teacher_spec, "normalisation_weights": result.norms,
             "kl_first": round(result.kl[0], 5), "kl_last_10": round(sum(last) / len(last), 5),
             "kl": [round(v, 5) for v in result.kl], "seconds": round(time.perf_counter() - started, 3)}
    return result.scales, entry


def main(config: QuantizeConfig) -> int:
    report = run(config)
    q = report["quantization"]
    layers = len(report["achieved_sparsity"]["per_layer"])
    head = f", lm_head {q['lm_head_bits']} bits" if q["lm_head_bits"] != 16 else ""
    typer.echo(f"{q['method']}: {layers} pruned layers quantized to {q['bits']} bits (group "
               f"{q['group_size']}, {q['grid']} grid){head} in {report['quantize_seconds']:.1f}s -> "
               f"{config.out}")
    return 0
