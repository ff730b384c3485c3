"""Round to nearest on the `bitmap-q4` grid, for the kept weights of a masked layer.

A group's scale is the one of `CLIP_STEPS` candidates (absmax/7.5 shrunk by 0% to 25%) whose grid puts
the group's kept weights closest in squared error: clipping the one largest weight often buys a finer
grid for all the others (llama.cpp's and GPTQ's `mse` scale searches do the same). Pruned weights play
no part: their grid position is never stored."""

import torch

from sparse_formats.bitmap_q4 import GRID_OFFSET, LEVELS, check_group_size

CLIP_STEPS = 16
SMALLEST_CLIP = 0.75


def search_scales(weight: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp16 scales [rows, cols/group_size] minimising the kept weights' squared rounding error."""
    rows, cols = weight.shape
    check_group_size(cols, group_size)
    w = weight.float().reshape(rows, cols // group_size, group_size)
    keep = mask.reshape(w.shape)
    top = torch.where(keep, w.abs(), torch.zeros((), device=w.device)).amax(dim=-1)
    best_scale = (top / GRID_OFFSET).to(torch.float16)
    best_error = torch.full_like(top, float("inf"))
    for shrink in torch.linspace(1.0, SMALLEST_CLIP, CLIP_STEPS).tolist():
        scale = (top * shrink / GRID_OFFSET).to(torch.float16)
        error = group_error(w, keep, scale)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scale = torch.where(better, scale, best_scale)
    return best_scale


def group_error(w: torch.Tensor, keep: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Squared rounding error of each group's kept weights [rows, groups] under fp16 `scale`."""
    s = scale.float().unsqueeze(-1)
    safe = torch.where(s > 0, s, torch.ones((), device=s.device))
    q = (torch.round(w / safe + GRID_OFFSET).clamp_(0, LEVELS - 1) - GRID_OFFSET) * s
    return torch.where(keep, (w - q) ** 2, torch.zeros((), device=w.device)).sum(dim=-1)


def round_to_grid(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 weight with every entry moved to the nearest level of its group's scale."""
    rows, cols = weight.shape
    s = scales.float().repeat_interleave(cols // scales.shape[1], dim=1)
    safe = torch.where(s > 0, s, torch.ones((), device=s.device))
    return (torch.round(weight.float() / safe + GRID_OFFSET).clamp_(0, LEVELS - 1) - GRID_OFFSET) * s


def rtn_quantize(weight: torch.Tensor, mask: torch.Tensor,
                 group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weight with kept entries on the grid and pruned ones +0.0, fp16 scales)."""
    scales = search_scales(weight, mask, group_size)
    quantized = round_to_grid(weight, scales)
    return torch.where(mask, quantized, torch.zeros((), device=quantized.device)), scales
