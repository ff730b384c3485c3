"""Every setting of `leapctl quantize`, declared once; the CLI is generated from it."""

from dataclasses import dataclass
from pathlib import Path

from leapctl.compute import DEVICE_HELP
from leapctl.errors import LeapctlError
from leapctl.grid import ASYMMETRIC, SUPPORTED_BITS, SYMMETRIC
from leapctl.settings import setting

LM_HEAD_BITS = (4, 8, 16)  # 16: lm_head left as it is
METHODS = ("gptq", "rtn")
# Calibration of a run whose masks used none (magnitude pruning): the shipped general-purpose text.
DEFAULT_CALIB = "wiki-summaries"


@dataclass
class QuantizeConfig:
    run: str = setting(help="A run folder from prune, learn or apply-mask (the pruned model and its masks).",
                       argument=True, metavar="RUN")
    out: Path = setting(help="Output run folder: the model with its kept weights on the 4-bit grid "
                             "(dequantized, fp32), masks, scales, report.json.")
    bits: int = setting(4, f"Bits per kept weight ({', '.join(map(str, SUPPORTED_BITS))}).")
    group_size: int = setting(64, "Input columns sharing one scale: a multiple of 32 that divides every "
                                  "pruned layer's columns (32, 64 or 128). 128 decodes ~5% faster but costs "
                                  "quality: on SmolLM2 LEAP 50% at every other default, groups of 128 in "
                                  "down_proj alone took WikiText-2's 4-bit cost from +4.5% to +6.9%.")
    grid: str = setting(ASYMMETRIC, "asymmetric (scale * (code - zero), a 4-bit zero point per group: 0.008 "
                                    "bytes per weight more at group 64; on SmolLM2 LEAP 50% at every other "
                                    "default +3.2% / +4.5% perplexity over the 16-bit values, the symmetric "
                                    "grid +4.8% / +9.4%) or symmetric (scale * (code - 7.5)).")
    method: str = setting("gptq", "gptq (error compensation with the mask fixed, calibrated block by "
                                  "block) or rtn (round to nearest, no calibration).")
    lm_head_bits: int = setting(8, "Bits of lm_head's weights: 8 (int8 codes, one fp16 scale per row; "
                                   "+0.1% perplexity on SmolLM2, half of the 16-bit bytes; a tied input "
                                   "embedding takes the same values), 4 (the 4-bit grid, every weight kept, "
                                   "by GPTQ with --method gptq, its scales tuned with the rest; untied from "
                                   "the input embedding, which keeps its values: a quarter of the 16-bit "
                                   "bytes, +1.1% WikiText-2 perplexity over 8 bits on SmolLM2 at 30%; "
                                   "compress's default) or 16 (left as it is). On small models lm_head is a "
                                   "large share of the bytes a decode step reads.")
    act_order: bool = setting(True, "gptq's column order: by decreasing input energy (the Hessian's "
                                    "diagonal), every group's grid fixed up front on its weights as they are "
                                    "(act order), or left to right, each group's grid searched when reached "
                                    "(--no-act-order). On SmolLM2 (LEAP 50%, asymmetric, untuned) act order "
                                    "cost +6.6% held-apart perplexity over the 16-bit values, left to right "
                                    "+14.3%.")
    tune_steps: int = setting(200, "Steps of end-to-end scale tuning after quantizing: every group scale and "
                                   "normalisation weight learned by distillation from the dense model, "
                                   "codes and masks fixed (0: none).")
    tune_lr: float = setting(1e-3, "Adam learning rate of the scale tuning (on log-scales; cosine to 0).")
    autocast: bool | None = setting(None, "bf16 autocast of the tuning's matmuls (default: where the device "
                                          "multiplies bf16 in hardware: CUDA, or a CPU with AVX512-BF16 or "
                                          "AMX; master scales and the KL stay fp32).")
    gradient_checkpointing: bool = setting(True, "Recompute each decoder block in the tuning's backward "
                                                 "instead of holding its activations (SmolLM2, 4 x 512 "
                                                 "tokens a step: 5.9 GB peak against 7.9, no slower, the "
                                                 "same scales).")
    teacher: str = setting("", "Dense model the tuning distils from (default: the model the run was pruned "
                               "from, as its masks name it).", metavar="MODEL")
    calib: str = setting("", "Calibration text for gptq and tuning: file, folder, .jsonl, saved dataset, "
                             "wiki-summaries or generated (default: the text the run's masks were "
                             f"calibrated or learned on, {DEFAULT_CALIB} when they used none).")
    nsamples: int = setting(128, "Calibration sequences (gptq and tuning).")
    seq_len: int = setting(512, "Tokens per calibration sequence (gptq and tuning).")
    seed: int = setting(0, "Seed of the calibration windows (or generated samples).")
    text_field: str = setting("text", "Text field of JSONL or dataset sources.")
    device: str = setting("auto", f"Where each block is computed: {DEVICE_HELP}.")
    batch_size: int = setting(8, "Calibration sequences per block forward (gptq) and per tuning step.")
    overwrite: bool = setting(False, "Replace a non-empty output folder.", flag="--overwrite")
    progress: bool = setting(True, "Show progress bars.")

    def validate(self) -> None:
        """One clear error for settings that cannot work, before any model is loaded."""
        if self.bits not in SUPPORTED_BITS:
            raise LeapctlError(f"--bits {self.bits} is not supported (supported: "
                               f"{', '.join(map(str, SUPPORTED_BITS))})")
        if self.lm_head_bits not in LM_HEAD_BITS:
            raise LeapctlError(f"--lm-head-bits {self.lm_head_bits} is not supported (supported: "
                               f"{', '.join(map(str, LM_HEAD_BITS))})")
        if self.group_size <= 0 or self.group_size % 32:
            raise LeapctlError(f"--group-size must be a positive multiple of 32, got {self.group_size}")
        if self.grid not in (SYMMETRIC, ASYMMETRIC):
            raise LeapctlError(f"unknown --grid {self.grid!r} (choose from {SYMMETRIC}, {ASYMMETRIC})")
        if self.method not in METHODS:
            raise LeapctlError(f"unknown --method {self.method!r} (choose from {', '.join(METHODS)})")
        if self.tune_steps < 0 or not self.tune_lr > 0:
            raise LeapctlError("--tune-steps must be >= 0 and --tune-lr > 0")
        if self.nsamples < 1 or self.seq_len < 2 or self.batch_size < 1:
            raise LeapctlError("--nsamples and --batch-size must be >= 1 and --seq-len >= 2")
