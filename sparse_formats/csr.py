"""The `csr` format: compressed sparse rows, the layout every sparse library reads.

Tensors for a [rows, cols] weight:
- `shape`: int64[2].
- `values`: kept values in row-major order, in the weight's dtype.
- `col_indices`: int32 [nnz], the column of each value, strictly increasing within a row.
- `row_ptr`: int64 [rows+1], row i holds values[row_ptr[i]:row_ptr[i+1]].

Four index bytes per kept weight: larger than `bitmap` at LLM sparsities, kept for interchange."""

import numpy as np
import torch

from sparse_formats.base import register
from sparse_formats.bitmap import DECODE_BLOCK
from sparse_formats.checks import (
    blocks,
    check_encode_inputs,
    check_offsets_order,
    first_index,
    from_raw_bits,
    in_parallel,
    raw_bits,
    read_shape,
    require,
    shape_tensor,
)
from sparse_formats.errors import FormatError


class CsrFormat:
    name = "csr"
    lossless = True

    def encode(self, weight: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Blocks of rows as in `bitmap`, on its thread pool: row counts first, so every block knows where
        its values go; then each block's kept positions are found once, in cache, and give its values and
        its columns. Columns are gathered from a column ramp with the same positions, about 5x cheaper
        than an int64 `%`."""
        check_encode_inputs(weight, mask)
        keep, bits = mask.contiguous().numpy(), raw_bits(weight)
        rows, cols = keep.shape
        row_blocks = list(blocks(rows, cols))
        row_ptr = np.zeros(rows + 1, dtype=np.int64)

        def count(block: tuple[int, int]) -> None:
            first, last = block
            row_ptr[first + 1:last + 1] = np.count_nonzero(keep[first:last], axis=1)

        in_parallel(count, row_blocks)
        np.cumsum(row_ptr, out=row_ptr)
        values = np.empty(row_ptr[-1], dtype=bits.dtype)
        col_indices = np.empty(row_ptr[-1], dtype=np.int32)
        ramp = np.tile(np.arange(cols, dtype=np.int32), row_blocks[0][1] if row_blocks else 0)

        def fill(block: tuple[int, int]) -> None:
            first, last = block
            kept = np.flatnonzero(keep[first:last])
            np.take(bits[first:last].reshape(-1), kept, out=values[row_ptr[first]:row_ptr[last]])
            np.take(ramp, kept, out=col_indices[row_ptr[first]:row_ptr[last]])

        in_parallel(fill, row_blocks)
        return {
            "shape": shape_tensor(weight),
            "values": from_raw_bits(values, weight.dtype),
            "col_indices": torch.from_numpy(col_indices),
            "row_ptr": torch.from_numpy(row_ptr),
        }

    def decode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Scatter in blocks of rows that fit in cache, as `bitmap` does."""
        rows, cols = read_shape(tensors, self.name)
        values, row_ptr = raw_bits(tensors["values"]), tensors["row_ptr"].numpy()
        col_indices = tensors["col_indices"].numpy()
        dense = np.zeros((rows, cols), dtype=values.dtype)
        block = max(1, DECODE_BLOCK // max(cols, 1))
        for first in range(0, rows, block):
            last = min(first + block, rows)
            begin, end = row_ptr[first], row_ptr[last]
            local_rows = np.repeat(np.arange(last - first, dtype=np.int64), np.diff(row_ptr[first:last + 1]))
            dense[first:last].reshape(-1)[local_rows * cols + col_indices[begin:end]] = values[begin:end]
        return from_raw_bits(dense, tensors["values"].dtype)

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        rows, cols = read_shape(tensors, self.name)
        values = require(tensors, self.name, "values", None, 1)
        col_indices = require(tensors, self.name, "col_indices", torch.int32, 1)
        row_ptr = require(tensors, self.name, "row_ptr", torch.int64, 1)
        if row_ptr.numel() != rows + 1:
            raise FormatError(f"csr: row_ptr has {row_ptr.numel()} entries, expected {rows + 1} (rows + 1)")
        check_offsets_order(self.name, "row_ptr", row_ptr, "row")
        nnz = int(row_ptr[-1])
        if values.numel() != nnz or col_indices.numel() != nnz:
            raise FormatError(f"csr: row_ptr ends at {nnz} but there are {values.numel()} values and "
                              f"{col_indices.numel()} col_indices (count mismatch)")
        if nnz == 0:
            return
        outside = (col_indices < 0) | (col_indices >= cols)
        if bool(outside.any()):
            at = first_index(outside)
            raise FormatError(f"csr: col_indices[{at}] = {int(col_indices[at])} is out of range for "
                              f"{cols} columns")
        row_start = torch.zeros(nnz, dtype=torch.bool)
        row_start[row_ptr[:-1][row_ptr[:-1] < nnz]] = True
        unordered = (col_indices[1:] <= col_indices[:-1]) & ~row_start[1:]
        if bool(unordered.any()):
            at = first_index(unordered) + 1
            raise FormatError(f"csr: col_indices[{at}] = {int(col_indices[at])} does not increase within "
                              f"its row (duplicate or unsorted column)")


CSR = register(CsrFormat())
