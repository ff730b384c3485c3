"""The per-layer quantizers, one registry (`QUANTIZERS`), each `run(model, mask_set, group_size, calib_ids,
grid, **options) -> (scales, zeros)`: `rtn` (`leapctl.grid`, no calibration) and `gptq` (GPTQ with the mask
fixed, calibrated block by block on the quantized blocks' outputs); and lm_head on its grid, every weight
kept. Each puts weights on the grid in place; `job.quantize_model` sequences them with the tuning."""

from collections.abc import Callable

import torch
from torch import nn

from leapctl.compute import resolve_device
from leapctl.errors import LeapctlError
from leapctl.grid import GRIDS, SYMMETRIC, Params, check_group_size, rtn_quantize, rtn_scales
from leapctl.masks import MaskSet
from leapctl.quantize.gptq import GPTQQuantizer
from sparse_formats import int8_rows

LM_HEAD = "lm_head.weight"


def gptq_scales(model: nn.Module, mask_set: MaskSet, group_size: int, calib_ids: torch.Tensor | None = None,
                grid: str = SYMMETRIC, device: str | torch.device | None = None, batch_size: int = 8,
                progress: bool = True, act_order: bool = True, lm_head: bool = False) -> Params:
    """GPTQ with the masks fixed, block by block (`prune.sequential.update_under_masks`), each block
    calibrated on what the already-quantized blocks produce; `act_order`: `gptq.gptq_quantize`'s.
    `lm_head`: lm_head too, 4-bit with every weight kept, on what it receives at the end of the same pass
    (as `quantize_lm_head` with `calib_ids` would, without running the blocks a second time)."""
    from leapctl.prune.sequential import update_under_masks

    if calib_ids is None:
        raise LeapctlError("gptq needs calibration data")
    scales: dict[str, torch.Tensor] = {}
    zeros: dict[str, torch.Tensor] = {}
    head = _head_on_grid(model, 4, group_size) if lm_head else None
    home = head.weight.device if head is not None else None
    head_gptq = None if head is None else _lm_head_quantizer(head, group_size, grid, scales, zeros, act_order,
                                                             device)
    update_under_masks(model, calib_ids, mask_set,
                       lambda linear, mask, name: GPTQQuantizer(linear, mask, group_size, scales, name, grid,
                                                                zeros, act_order),
                       "gptq 4-bit", device=device, batch_size=batch_size, progress=progress,
                       lm_head_inputs=None if head_gptq is None else head_gptq.add_batch)
    if head_gptq is not None:
        head_gptq.prune(0.0)
        head.to(home)
    return scales, zeros


QUANTIZERS: dict[str, Callable[..., Params]] = {"gptq": gptq_scales, "rtn": rtn_scales}


def quantize_weights(model: nn.Module, mask_set: MaskSet, method: str = "gptq", group_size: int = 64,
                     calib_ids: torch.Tensor | None = None, grid: str = SYMMETRIC, **options) -> Params:
    """Quantize the kept weights of every masked layer in place (the model must be fp32: the grid values
    are exact only there); returns the fp16 scales per weight name, and the uint8 zero points on the
    asymmetric grid (empty on the symmetric one)."""
    if method not in QUANTIZERS:
        raise LeapctlError(f"unknown quantization method {method!r} (choose from {', '.join(QUANTIZERS)})")
    if grid not in GRIDS:
        raise LeapctlError(f"unknown grid {grid!r} (choose from {', '.join(GRIDS)})")
    check_group_size(mask_set, group_size)
    dtypes = {model.get_submodule(name.removesuffix(".weight")).weight.dtype for name in mask_set.masks}
    if dtypes != {torch.float32}:
        raise LeapctlError(f"quantize needs the model in float32, got {sorted(map(str, dtypes))}")
    return QUANTIZERS[method](model, mask_set, group_size, calib_ids, grid, **options)


@torch.no_grad()
def quantize_lm_head(model: nn.Module, bits: int, group_size: int, grid: str = SYMMETRIC,
                     calib_ids: torch.Tensor | None = None, device: str | torch.device | None = None,
                     batch_size: int = 8, act_order: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """lm_head's weight on the `bits` grid, every entry kept (a tied input embedding is the same tensor, so
    it takes the same values); returns its fp16 scales, [rows, groups] on a 4-bit `grid` (with its zero
    points on the asymmetric one), [rows] on the 8-bit one (`sparse_formats.int8_rows`), and the zero
    points or None. 4 bits with `calib_ids`: GPTQ on what lm_head receives from the model as it is (its
    blocks already quantized), else round to nearest. On SmolLM2-135M (dense, untied, asymmetric, groups of
    64) GPTQ's head cost WikiText-2 +3.6% where rounding to nearest cost +11.8%."""
    head = _head_on_grid(model, bits, group_size)
    if bits == 8:
        scales = int8_rows.row_scales(head.weight)
        head.weight.copy_(int8_rows.dequantize(int8_rows.quantize_codes(head.weight, scales), scales)
                          .to(head.weight.dtype))
        return scales.cpu(), None
    if calib_ids is None:
        everything = torch.ones(head.weight.shape, dtype=torch.bool, device=head.weight.device)
        weight, scales, zeros = rtn_quantize(head.weight, everything, group_size, grid)
        head.weight.copy_(weight.to(head.weight.dtype))
        return scales.cpu(), None if zeros is None else zeros.cpu()
    from leapctl.prune.sequential import feed_lm_head_inputs

    home = head.weight.device
    found: dict[str, torch.Tensor] = {}
    found_zeros: dict[str, torch.Tensor] = {}
    quantizer = _lm_head_quantizer(head, group_size, grid, found, found_zeros, act_order, device)
    feed_lm_head_inputs(model, calib_ids, quantizer.add_batch, device, batch_size)
    quantizer.prune(0.0)
    head.to(home)
    return found[LM_HEAD], found_zeros.get(LM_HEAD)


def _head_on_grid(model: nn.Module, bits: int, group_size: int) -> nn.Linear:
    """The model's lm_head, checked for the `bits` grid."""
    head = model.get_output_embeddings()
    if head is None:
        raise LeapctlError("--lm-head-bits: the model has no lm_head (use --lm-head-bits 16)")
    if bits == 4 and head.weight.shape[1] % group_size:
        raise LeapctlError(f"--lm-head-bits 4: --group-size {group_size} does not divide the "
                           f"{head.weight.shape[1]} input columns of lm_head")
    return head


def _lm_head_quantizer(head: nn.Linear, group_size: int, grid: str, scales: dict, zeros: dict,
                       act_order: bool, device: str | torch.device | None) -> GPTQQuantizer:
    """GPTQ's quantizer for lm_head, every weight kept, on `device` (where its inputs will come from)."""
    head.to(resolve_device(device))
    everything = torch.ones(head.weight.shape, dtype=torch.bool, device=head.weight.device)
    return GPTQQuantizer(head, everything, group_size, scales, LM_HEAD, grid, zeros, act_order)
