"""4-bit quantization of a pruned model's kept weights, on a `bitmap-q4` grid (sparse_formats.bitmap_q4):
each kept weight becomes `scale * (code - 7.5)` (symmetric) or `scale * (code - zero)` (asymmetric, an
integer zero point per group) with an fp16 scale per row and group of input columns.

Two methods in one registry, each `run(model, mask_set, group_size, calib_ids, grid, **options) -> (scales,
zeros)`:
`rtn` (round to nearest, scale searched per group) and `gptq` (GPTQ restricted to the kept weights with
the mask fixed, calibrated block by block on the quantized blocks' outputs). Both quantize the model in
place: its weights become the dequantized values (exact in fp32), so a quantized run folder is an
ordinary checkpoint that eval, transformers and stock vLLM read, and `export --format bitmap-q4` turns
it into codes and scales bit for bit. `leapctl.commands.quantize` is `leapctl quantize`."""

from collections.abc import Callable

import torch
from torch import nn

from leapctl.errors import LeapctlError
from leapctl.masks import MaskSet
from leapctl.quantize.config import QuantizeConfig
from leapctl.quantize.gptq import GPTQQuantizer
from leapctl.quantize.rtn import ASYMMETRIC, GRIDS, SYMMETRIC, rtn_quantize
from sparse_formats import int8_rows

FORMAT = "bitmap-q4"


def check_group_size(mask_set: MaskSet, group_size: int) -> None:
    """One line naming the first pruned layer whose columns the group size does not divide."""
    if group_size <= 0 or group_size % 32:
        raise LeapctlError(f"--group-size must be a positive multiple of 32, got {group_size}")
    for name, mask in mask_set.masks.items():
        if mask.shape[1] % group_size:
            raise LeapctlError(f"--group-size {group_size} does not divide the {mask.shape[1]} input columns "
                               f"of {name}")


def _linear(model: nn.Module, weight_name: str) -> nn.Linear:
    return model.get_submodule(weight_name.removesuffix(".weight"))


Params = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]  # (fp16 scales, uint8 zero points) per name


@torch.no_grad()
def rtn_scales(model: nn.Module, mask_set: MaskSet, group_size: int, calib_ids=None, grid: str = SYMMETRIC,
               **_options) -> Params:
    """Round each masked layer's kept weights to nearest; no calibration."""
    scales, zeros = {}, {}
    for name, mask in mask_set.masks.items():
        linear = _linear(model, name)
        weight, scale, zero = rtn_quantize(linear.weight, mask.to(linear.weight.device), group_size, grid)
        linear.weight.copy_(weight.to(linear.weight.dtype))
        scales[name] = scale.cpu()
        if zero is not None:
            zeros[name] = zero.cpu()
    return scales, zeros


def gptq_scales(model: nn.Module, mask_set: MaskSet, group_size: int, calib_ids: torch.Tensor | None = None,
                grid: str = SYMMETRIC, device: str | torch.device | None = None, batch_size: int = 8,
                progress: bool = True, act_order: bool = True) -> Params:
    """GPTQ with the masks fixed, block by block (`prune.sequential.update_under_masks`), each block
    calibrated on what the already-quantized blocks produce; `act_order`: `gptq.gptq_quantize`'s."""
    from leapctl.prune.sequential import update_under_masks

    if calib_ids is None:
        raise LeapctlError("gptq needs calibration data")
    scales: dict[str, torch.Tensor] = {}
    zeros: dict[str, torch.Tensor] = {}
    update_under_masks(model, calib_ids, mask_set,
                       lambda linear, mask, name: GPTQQuantizer(linear, mask, group_size, scales, name, grid,
                                                                zeros, act_order),
                       "gptq 4-bit", device=device, batch_size=batch_size, progress=progress)
    return scales, zeros


QUANTIZERS: dict[str, Callable[..., Params]] = {"gptq": gptq_scales, "rtn": rtn_scales}


def quantize_model(model: nn.Module, mask_set: MaskSet, method: str = "gptq", group_size: int = 64,
                   calib_ids: torch.Tensor | None = None, grid: str = SYMMETRIC, **options) -> Params:
    """Quantize the kept weights of every masked layer in place (the model must be fp32: the grid values
    are exact only there); returns the fp16 scales per weight name, and the uint8 zero points on the
    asymmetric grid (empty on the symmetric one)."""
    if method not in QUANTIZERS:
        raise LeapctlError(f"unknown quantization method {method!r} (choose from {', '.join(QUANTIZERS)})")
    if grid not in GRIDS:
        raise LeapctlError(f"unknown grid {grid!r} (choose from {', '.join(GRIDS)})")
    check_group_size(mask_set, group_size)
    dtypes = {_linear(model, name).weight.dtype for name in mask_set.masks}
    if dtypes != {torch.float32}:
        raise LeapctlError(f"quantize needs the model in float32, got {sorted(map(str, dtypes))}")
    return QUANTIZERS[method](model, mask_set, group_size, calib_ids, grid, **options)


LM_HEAD = "lm_head.weight"


@torch.no_grad()
def quantize_lm_head(model: nn.Module, bits: int, group_size: int,
                     grid: str = SYMMETRIC) -> tuple[torch.Tensor, torch.Tensor | None]:
    """lm_head's weight on the `bits` grid, every entry kept (a tied input embedding is the same tensor, so
    it takes the same values); returns its fp16 scales, [rows, groups] on a 4-bit `grid` (with its zero
    points on the asymmetric one), [rows] on the 8-bit one (`sparse_formats.int8_rows`), and the zero
    points or None."""
    head = model.get_output_embeddings()
    if head is None:
        raise LeapctlError("--lm-head-bits: the model has no lm_head (use --lm-head-bits 16)")
    if bits == 8:
        scales = int8_rows.row_scales(head.weight)
        head.weight.copy_(int8_rows.dequantize(int8_rows.quantize_codes(head.weight, scales), scales)
                          .to(head.weight.dtype))
        return scales.cpu(), None
    if head.weight.shape[1] % group_size:
        raise LeapctlError(f"--lm-head-bits 4: --group-size {group_size} does not divide the "
                           f"{head.weight.shape[1]} input columns of lm_head")
    everything = torch.ones(head.weight.shape, dtype=torch.bool, device=head.weight.device)
    weight, scales, zeros = rtn_quantize(head.weight, everything, group_size, grid)
    head.weight.copy_(weight.to(head.weight.dtype))
    return scales.cpu(), None if zeros is None else zeros.cpu()


def lm_head_bits(quantization: dict) -> int:
    """The bits of lm_head's grid a run's `quantization` entry records (16: not quantized); runs written
    before `--lm-head-bits` said `lm_head: true` for the 4-bit grid."""
    if "lm_head_bits" in quantization:
        return int(quantization["lm_head_bits"])
    return 4 if quantization.get("lm_head") else 16


GRID_VALUES = {SYMMETRIC: "scale * (code - 7.5), code in 0..15, fp16 scale per row and group",
               ASYMMETRIC: "scale * (code - zero), code and zero in 0..15, fp16 scale and 4-bit zero per row "
                           "and group"}


def quantization_entry(bits: int, group_size: int, method: str, lm_head_bits: int = 16,
                       grid: str = SYMMETRIC) -> dict:
    """What a quantized run's report says about its grid (export and validate read it)."""
    return {"bits": bits, "group_size": group_size, "method": method, "format": FORMAT,
            "lm_head_bits": lm_head_bits, "grid": grid, "values": GRID_VALUES[grid]}


__all__ = ["ASYMMETRIC", "GRIDS", "LM_HEAD", "QUANTIZERS", "QuantizeConfig", "SYMMETRIC", "lm_head_bits",
           "quantization_entry", "quantize_model"]
