"""The 4-bit `bitmap-q4` grid that kept weights sit on: each group's parameters searched, weights rounded
to it, and round to nearest over a model's masked layers. Its own module because both `quantize` (rtn, and
GPTQ's per-group search) and `learn --bits` (kept weights frozen on the grid while the mask learns) put
weights on it, and neither of those packages imports the other; the grid's levels themselves are
`sparse_formats.bitmap_q4`.

Two grids (`GRIDS`): symmetric, `scale * (code - 7.5)`, and asymmetric, `scale * (code - zero)` with an
integer zero point per group. A group's parameters are the one of `CLIP_STEPS` candidates (the kept
weights' range shrunk by 0% to 25%) whose grid puts the group's kept weights closest in squared error:
clipping the one largest weight often buys a finer grid for all the others (llama.cpp's and GPTQ's `mse`
scale searches do the same). Pruned weights play no part: their grid position is never stored."""

from collections.abc import Callable

import torch
from torch import nn

from leapctl.errors import LeapctlError
from leapctl.masks import MaskSet
from sparse_formats import bitmap_q4
from sparse_formats.bitmap_q4 import GRID_OFFSET, LEVELS, grid_offset

SUPPORTED_BITS = (4,)  # bits per kept weight
SYMMETRIC, ASYMMETRIC = "symmetric", "asymmetric"  # the bitmap-q4 grids (`GRIDS`)
CLIP_STEPS = 16
SMALLEST_CLIP = 0.75


def _shrinks() -> list[float]:
    return torch.linspace(1.0, SMALLEST_CLIP, CLIP_STEPS).tolist()


def _groups(weight: torch.Tensor, mask: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    bitmap_q4.check_group_size(cols, group_size)
    shape = (rows, cols // group_size, group_size)
    return weight.float().reshape(shape), mask.reshape(shape)


def search_scales(weight: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp16 scales [rows, cols/group_size] of the symmetric grid minimising the kept weights' squared
    rounding error."""
    w, keep = _groups(weight, mask, group_size)
    top = torch.where(keep, w.abs(), torch.zeros((), device=w.device)).amax(dim=-1)
    best_scale = (top / GRID_OFFSET).to(torch.float16)
    best_error = torch.full_like(top, float("inf"))
    for shrink in _shrinks():
        scale = (top * shrink / GRID_OFFSET).to(torch.float16)
        error = group_error(w, keep, scale)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scale = torch.where(better, scale, best_scale)
    return best_scale


def search_asymmetric(weight: torch.Tensor, mask: torch.Tensor,
                      group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp16 scales, uint8 zero points) [rows, cols/group_size] of the asymmetric grid minimising the kept
    weights' squared rounding error. The range always holds 0 (the zero point is a level); each candidate
    shrinks both of its ends alike."""
    w, keep = _groups(weight, mask, group_size)
    big = torch.finfo(torch.float32).max
    low = torch.where(keep, w, torch.full((), big, device=w.device)).amin(dim=-1).clamp(max=0)
    high = torch.where(keep, w, torch.full((), -big, device=w.device)).amax(dim=-1).clamp(min=0)
    best_error = torch.full_like(low, float("inf"))
    best_scale = torch.zeros(low.shape, dtype=torch.float16, device=w.device)
    best_zero = torch.zeros(low.shape, dtype=torch.uint8, device=w.device)
    for shrink in _shrinks():
        scale = ((high - low) * shrink / (LEVELS - 1)).to(torch.float16)
        safe = torch.where(scale > 0, scale.float(), torch.ones((), device=w.device))
        zero = torch.round(-low * shrink / safe).clamp_(0, LEVELS - 1).to(torch.uint8)
        error = group_error(w, keep, scale, zero)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    return best_scale, best_zero


def _levels(w: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | float) -> torch.Tensor:
    """w moved to its nearest level `scale * (code - offset)`, code in 0..15 (scale and offset broadcast)."""
    safe = torch.where(scale > 0, scale, torch.ones((), device=scale.device))
    return (torch.round(w / safe + offset).clamp_(0, LEVELS - 1) - offset) * scale


def group_error(w: torch.Tensor, keep: torch.Tensor, scale: torch.Tensor,
                zero: torch.Tensor | None = None) -> torch.Tensor:
    """Squared rounding error of each group's kept weights [rows, groups] under fp16 `scale` (and the
    asymmetric grid's `zero` points)."""
    offset = GRID_OFFSET if zero is None else zero.float().unsqueeze(-1)
    q = _levels(w, scale.float().unsqueeze(-1), offset)
    return torch.where(keep, (w - q) ** 2, torch.zeros((), device=w.device)).sum(dim=-1)


def round_to_grid(weight: torch.Tensor, scales: torch.Tensor,
                  zeros: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 weight with every entry moved to the nearest level of its group's scale (and zero point)."""
    rows, cols = weight.shape
    s = scales.float().repeat_interleave(cols // scales.shape[1], dim=1)
    return _levels(weight.float(), s, grid_offset(zeros, cols))


def _symmetric(weight: torch.Tensor, mask: torch.Tensor, group_size: int) -> tuple[torch.Tensor, None]:
    return search_scales(weight, mask, group_size), None


# Grid name -> search(weight, mask, group_size) -> (fp16 scales, uint8 zero points or None).
GRIDS: dict[str, Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]]] = {
    SYMMETRIC: _symmetric, ASYMMETRIC: search_asymmetric}


def rtn_quantize(weight: torch.Tensor, mask: torch.Tensor, group_size: int,
                 grid: str = SYMMETRIC) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(fp32 weight with kept entries on the grid and pruned ones +0.0, fp16 scales, zero points or None)."""
    scales, zeros = GRIDS[grid](weight, mask, group_size)
    quantized = round_to_grid(weight, scales, zeros)
    return torch.where(mask, quantized, torch.zeros((), device=quantized.device)), scales, zeros


def check_group_size(mask_set: MaskSet, group_size: int) -> None:
    """One line naming the first pruned layer whose columns the group size does not divide."""
    if group_size <= 0 or group_size % 32:
        raise LeapctlError(f"--group-size must be a positive multiple of 32, got {group_size}")
    for name, mask in mask_set.masks.items():
        if mask.shape[1] % group_size:
            raise LeapctlError(f"--group-size {group_size} does not divide the {mask.shape[1]} input columns "
                               f"of {name}")


Params = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]  # (fp16 scales, uint8 zero points) per name


@torch.no_grad()
def rtn_scales(model: nn.Module, mask_set: MaskSet, group_size: int, calib_ids=None, grid: str = SYMMETRIC,
               **_options) -> Params:
    """Round each masked layer's kept weights to nearest in place; no calibration (`calib_ids` and
    `_options` are the quantizer registry's signature)."""
    scales, zeros = {}, {}
    for name, mask in mask_set.masks.items():
        linear = model.get_submodule(name.removesuffix(".weight"))
        weight, scale, zero = rtn_quantize(linear.weight, mask.to(linear.weight.device), group_size, grid)
        linear.weight.copy_(weight.to(linear.weight.dtype))
        scales[name] = scale.cpu()
        if zero is not None:
            zeros[name] = zero.cpu()
    return scales, zeros
