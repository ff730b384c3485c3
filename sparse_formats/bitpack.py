"""Row-packed bitmaps, little-endian within a byte: bit j of byte b in a row is column 8*b + j.

This is compressed-tensors' `sparse-bitmask` layout and leapctl's on-disk mask layout."""

import torch

_BIT_WEIGHTS = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8)


def packed_cols(cols: int) -> int:
    """Bytes per row for `cols` columns."""
    return (cols + 7) // 8


def pack_rows(mask: torch.Tensor) -> torch.Tensor:
    """Pack a 2-D boolean mask [rows, cols] into uint8 [rows, ceil(cols/8)]."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D, got shape {tuple(mask.shape)}")
    rows, cols = mask.shape
    pad = packed_cols(cols) * 8 - cols
    bits = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).view(rows, packed_cols(cols), 8)
    return (bits * _BIT_WEIGHTS.to(mask.device)).sum(dim=-1, dtype=torch.uint8)


def unpack_rows(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """Inverse of `pack_rows`: uint8 [rows, ceil(cols/8)] -> bool [rows, cols]."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed bitmap must be 2-D uint8, got {packed.dtype} {tuple(packed.shape)}")
    if packed.shape[1] != packed_cols(cols):
        raise ValueError(f"packed bitmap has {packed.shape[1]} bytes per row, {cols} columns need "
                         f"{packed_cols(cols)}")
    bits = (packed.unsqueeze(-1) & _BIT_WEIGHTS.to(packed.device)) != 0
    return bits.view(packed.shape[0], packed.shape[1] * 8)[:, :cols]
