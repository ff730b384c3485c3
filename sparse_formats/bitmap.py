"""The `bitmap` format: the serving format on disk (compressed-tensors' sparse-bitmask layout, renamed).

Tensors for a [rows, cols] weight:
- `shape`: int64[2].
- `bitmap`: uint8 [rows, ceil(cols/8)], bit j of byte b in a row is column 8b+j (little-endian, as
  `numpy.packbits(..., bitorder="little")`); padding bits past `cols` are zero.
- `values`: the kept values in row-major order, in the weight's dtype.
- `row_offsets`: int64 [rows], index in `values` of each row's first kept value, so that a row can be
  decoded (or a row-parallel shard cut) without scanning the rows before it.

One bit per weight plus the kept values: at 50% sparsity with 16-bit values, 1.125 bytes per weight."""

import numpy as np
import torch

from sparse_formats.base import register
from sparse_formats.bitpack import packed_cols
from sparse_formats.checks import (
    POPCOUNT,
    blocks,
    check_encode_inputs,
    check_offsets_order,
    exclusive_cumsum,
    first_index,
    from_raw_bits,
    in_parallel,
    raw_bits,
    read_shape,
    require,
    shape_tensor,
)
from sparse_formats.errors import FormatError

DECODE_BLOCK = 1 << 20  # weights per decode block


class BitmapFormat:
    name = "bitmap"
    lossless = True

    def encode(self, weight: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Row counts come from the packed bitmap (`np.bitwise_count`, one pass over 1/8 of the bytes),
        so every block of rows knows where its values go and compacts them in cache (`ENCODE_BLOCK`)."""
        check_encode_inputs(weight, mask)
        keep, bits = mask.contiguous().numpy(), raw_bits(weight)
        ranges = list(blocks(*keep.shape))
        bitmap = np.empty((keep.shape[0], packed_cols(keep.shape[1])), dtype=np.uint8)

        def pack(rows: tuple[int, int]) -> None:
            bitmap[rows[0]:rows[1]] = np.packbits(keep[rows[0]:rows[1]], axis=1, bitorder="little")

        in_parallel(pack, ranges)
        starts = exclusive_cumsum(np.bitwise_count(bitmap).sum(axis=1, dtype=np.int64))
        values = np.empty(starts[-1], dtype=bits.dtype)

        def compact(rows: tuple[int, int]) -> None:
            first, last = rows
            np.compress(keep[first:last].reshape(-1), bits[first:last].reshape(-1),
                        out=values[starts[first]:starts[last]])

        in_parallel(compact, ranges)
        return {
            "shape": shape_tensor(weight),
            "bitmap": torch.from_numpy(bitmap),
            "values": from_raw_bits(values, weight.dtype),
            "row_offsets": torch.from_numpy(starts[:-1]),
        }

    def decode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Scatter the values in blocks of rows that fit in cache (about 4x faster than one scatter over
        a large matrix); `row_offsets` says where each block's values start."""
        rows, cols = read_shape(tensors, self.name)
        bitmap, values = tensors["bitmap"].numpy(), raw_bits(tensors["values"])
        starts = np.append(tensors["row_offsets"].numpy(), values.size)
        dense = np.zeros((rows, cols), dtype=values.dtype)
        block = max(1, DECODE_BLOCK // max(cols, 1))
        for first in range(0, rows, block):
            last = min(first + block, rows)
            keep = np.unpackbits(bitmap[first:last], axis=1, count=cols, bitorder="little").view(bool)
            dense[first:last].reshape(-1)[np.flatnonzero(keep)] = values[starts[first]:starts[last]]
        return from_raw_bits(dense, tensors["values"].dtype)

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        rows, cols = read_shape(tensors, self.name)
        bitmap = require(tensors, self.name, "bitmap", torch.uint8, 2)
        values = require(tensors, self.name, "values", None, 1)
        offsets = require(tensors, self.name, "row_offsets", torch.int64, 1)
        check_bitmap_layout(self.name, rows, cols, bitmap, values, offsets)


def check_bitmap_layout(fmt: str, rows: int, cols: int, bitmap: torch.Tensor, values: torch.Tensor,
                        offsets: torch.Tensor,
                        names: tuple[str, str, str] = ("bitmap", "values", "row_offsets")) -> None:
    """Consistency of a row-packed bitmap, its values and row offsets (shared with compressed-tensors'
    layout, whose tensors have other names)."""
    bitmap_name, values_name, offsets_name = names
    if tuple(bitmap.shape) != (rows, packed_cols(cols)):
        raise FormatError(f"{fmt}: {bitmap_name} has shape {tuple(bitmap.shape)}, a {rows}x{cols} weight "
                          f"needs {(rows, packed_cols(cols))}")
    spare = packed_cols(cols) * 8 - cols
    if spare and rows and bool((bitmap[:, -1] >> (8 - spare)).any()):
        row = first_index((bitmap[:, -1] >> (8 - spare)) != 0)
        raise FormatError(f"{fmt}: {bitmap_name} row {row} marks a position past column {cols - 1} "
                          f"(position out of range)")
    if offsets.numel() != rows:
        raise FormatError(f"{fmt}: {offsets_name} has {offsets.numel()} entries, expected {rows} "
                          f"(one per row)")
    counts = POPCOUNT[bitmap.long()].sum(dim=1) if rows else torch.zeros(0, dtype=torch.int64)
    total = int(counts.sum())
    if values.numel() != total:
        raise FormatError(f"{fmt}: {bitmap_name} marks {total} kept weights but {values_name} holds "
                          f"{values.numel()} (bitmap/value count mismatch)")
    if rows == 0:
        return
    check_offsets_order(fmt, offsets_name, offsets, "row")
    expected = counts.cumsum(0) - counts
    if not torch.equal(offsets, expected):
        row = first_index(offsets != expected)
        raise FormatError(f"{fmt}: {offsets_name}[{row}] is {int(offsets[row])}, but the {bitmap_name} puts "
                          f"that row's first value at {int(expected[row])}")


BITMAP = register(BitmapFormat())
