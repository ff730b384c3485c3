"""The whole quantize job as one call, `quantize_model(model, tokenizer, mask_set, config)`: the kept
weights on the grid (`config.method`), lm_head on its own (4 bits before the tuning, so that its scales are
tuned with the rest; 8 bits after it, since that grid has no scales worth learning), then end-to-end scale
tuning against the dense model; and what a quantized run's report says about its grid."""

import time
from dataclasses import dataclass

import torch
from torch import nn

from leapctl.compute import native_bf16, resolve_device
from leapctl.data import calibration_batch, training_windows
from leapctl.errors import LeapctlError
from leapctl.grid import ASYMMETRIC, SYMMETRIC
from leapctl.masks import MaskSet
from leapctl.models import load_model, untie_output_embeddings
from leapctl.quantize.config import DEFAULT_CALIB, QuantizeConfig
from leapctl.quantize.methods import LM_HEAD, quantize_lm_head, quantize_weights
from leapctl.quantize.tune import tune_scales

FORMAT = "bitmap-q4"
GRID_VALUES = {SYMMETRIC: "scale * (code - 7.5), code in 0..15, fp16 scale per row and group",
               ASYMMETRIC: "scale * (code - zero), code and zero in 0..15, fp16 scale and 4-bit zero per row "
                           "and group"}


def quantization_entry(bits: int, group_size: int, method: str, lm_head_bits: int = 16,
                       grid: str = SYMMETRIC) -> dict:
    """What a quantized run's report says about its grid (export and validate read it)."""
    return {"bits": bits, "group_size": group_size, "method": method, "format": FORMAT,
            "lm_head_bits": lm_head_bits, "grid": grid, "values": GRID_VALUES[grid]}


def lm_head_bits(quantization: dict) -> int:
    """The bits of lm_head's grid a run's `quantization` entry records (16: not quantized); runs written
    before `--lm-head-bits` said `lm_head: true` for the 4-bit grid."""
    if "lm_head_bits" in quantization:
        return int(quantization["lm_head_bits"])
    return 4 if quantization.get("lm_head") else 16


def tuning_teacher(config: QuantizeConfig, mask_set: MaskSet) -> str:
    """The dense model the tuning distils from: `config.teacher`, else the model the masks were made on."""
    teacher = config.teacher or mask_set.model
    if not teacher:
        raise LeapctlError(f"{config.run}'s masks name no model to tune against: pass --teacher MODEL "
                           f"(the dense model) or --tune-steps 0")
    return teacher


@dataclass
class Quantized:
    """What `quantize_model` did: the grid parameters a run folder stores, and its report's entries."""

    scales: dict[str, torch.Tensor]  # fp16, per weight name (lm_head's included when it was quantized)
    zeros: dict[str, torch.Tensor]  # uint8 zero points on the asymmetric grid, else empty
    quantization: dict  # `quantization_entry`
    calibration: dict | None  # gptq's calibration text, None for rtn
    tuning: dict | None  # the scale tuning's settings and KL curve, None without tuning
    seconds: float  # the quantizer and the 4-bit lm_head, without the tuning


def quantize_model(model: nn.Module, tokenizer, mask_set: MaskSet, config: QuantizeConfig) -> Quantized:
    """Quantize `model` (fp32, pruned by `mask_set`) in place as `leapctl quantize` does, from `config`'s
    settings; gptq and the tuning read `config.calib` (default: wiki-summaries), the tuning distils from
    `tuning_teacher`. `run`, `out` and `overwrite` are the command's, not read here."""
    config.validate()
    calib = config.calib or DEFAULT_CALIB
    calib_ids, calibration = None, None
    if config.method == "gptq":
        calib_ids = calibration_batch(calib, tokenizer, config.nsamples, config.seq_len, config.seed,
                                      model=model, text_field=config.text_field)
        calibration = {"source": calib, "nsamples": config.nsamples, "seq_len": config.seq_len,
                       "seed": config.seed, "tokens": int(calib_ids.numel()), "act_order": config.act_order}
    started = time.perf_counter()
    if config.lm_head_bits == 4:  # before the blocks' pass and the tuning, which learns its scales too
        untie_output_embeddings(model)  # the input embedding keeps its values
    options = {} if config.method == "rtn" else dict(device=config.device, batch_size=config.batch_size,
                                                       progress=config.progress, act_order=config.act_order,
                                                       lm_head=config.lm_head_bits == 4)
    scales, zeros = quantize_weights(model, mask_set, config.method, config.group_size, calib_ids,
                                     config.grid, **options)
    if config.lm_head_bits == 4 and LM_HEAD not in scales:  # rtn: lm_head rounded to nearest too
        scales[LM_HEAD], head_zeros = quantize_lm_head(model, 4, config.group_size, config.grid)
        if head_zeros is not None:
            zeros[LM_HEAD] = head_zeros
    seconds = time.perf_counter() - started
    tuning = None
    if config.tune_steps:
        scales, tuning = _tune(model, tokenizer, tuning_teacher(config, mask_set), scales, calib, config)
    if config.lm_head_bits == 8:  # after tuning: its 8-bit grid has no scales worth learning
        scales[LM_HEAD], _ = quantize_lm_head(model, 8, config.group_size)
    entry = quantization_entry(config.bits, config.group_size, config.method, config.lm_head_bits,
                               config.grid)
    return Quantized(scales, zeros, entry, calibration, tuning, seconds)


def _tune(model: nn.Module, tokenizer, teacher_spec: str, scales: dict, calib: str,
          config: QuantizeConfig) -> tuple[dict, dict]:
    """The scales after end-to-end tuning against the dense model `teacher_spec` on `calib`'s text, and the
    report's entry."""
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
