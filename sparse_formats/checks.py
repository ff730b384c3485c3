"""Shared validation helpers for format `check()` functions: each failure is a `FormatError` that names
the format, the tensor and what is wrong, so that `leapctl validate` can print it as is."""

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from sparse_formats.errors import FormatError

_POOLS: dict[int, ThreadPoolExecutor] = {}
THREADS_ENV = "SPARSE_FORMATS_THREADS"  # encoder threads; default min(8, CPU count), 1 for serial

# Number of set bits in every byte value; indexing it with a uint8 bitmap counts kept weights per byte.
POPCOUNT = torch.tensor([bin(b).count("1") for b in range(256)], dtype=torch.int64)


def require(tensors: dict[str, torch.Tensor], fmt: str, key: str, dtype: torch.dtype | None = None,
            dim: int | None = None) -> torch.Tensor:
    """The tensor `key`, or a FormatError if it is missing or has the wrong dtype or rank."""
    if key not in tensors:
        raise FormatError(f"{fmt}: tensor {key!r} is missing")
    tensor = tensors[key]
    if dtype is not None and tensor.dtype != dtype:
        raise FormatError(f"{fmt}: {key} has dtype {tensor.dtype}, expected {dtype}")
    if dim is not None and tensor.dim() != dim:
        raise FormatError(f"{fmt}: {key} has {tensor.dim()} dimensions, expected {dim}")
    return tensor


def read_shape(tensors: dict[str, torch.Tensor], fmt: str) -> tuple[int, int]:
    """(rows, cols) from the `shape` tensor (int64[2], both >= 0)."""
    shape = require(tensors, fmt, "shape", torch.int64, 1)
    if shape.numel() != 2:
        raise FormatError(f"{fmt}: shape has {shape.numel()} entries, expected 2")
    rows, cols = (int(v) for v in shape.tolist())
    if rows < 0 or cols < 0:
        raise FormatError(f"{fmt}: shape {rows}x{cols} is negative")
    return rows, cols


def shape_tensor(weight: torch.Tensor) -> torch.Tensor:
    return torch.tensor(list(weight.shape), dtype=torch.int64)


def check_encode_inputs(weight: torch.Tensor, mask: torch.Tensor) -> None:
    """Programming errors in encode arguments are ValueErrors: these are not corrupt files."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D, got shape {tuple(weight.shape)}")
    if mask.shape != weight.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} differs from weight shape {tuple(weight.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")


def first_index(flags: torch.Tensor) -> int:
    """Index of the first True in a 1-D bool tensor (callers know there is one)."""
    return int(flags.nonzero()[0, 0])


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_offsets_order(fmt: str, name: str, offsets: torch.Tensor, unit: str) -> None:
    """Offsets into a values array start at 0 and never decrease; the error names the first entry that
    falls below the one before it (`unit` says what an entry indexes: row, tile)."""
    if int(offsets[0]) != 0:
        raise FormatError(f"{fmt}: {name}[0] is {int(offsets[0])}, expected 0")
    steps = offsets[1:] - offsets[:-1]
    if bool((steps < 0).any()):
        at = first_index(steps < 0) + 1
        raise FormatError(f"{fmt}: {name} is not monotone at {unit} {at} "
                          f"({int(offsets[at - 1])} then {int(offsets[at])})")


def raw_bits(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bits as a numpy integer array (no copy when contiguous): numpy has no bf16, and
    moving bits rather than numbers keeps every round trip exact, -0.0 and NaN payloads included."""
    return tensor.contiguous().view(_INT_OF_SIZE[tensor.element_size()]).numpy()


def from_raw_bits(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(array).view(dtype)


ENCODE_BLOCK = 1 << 18
"""Weights per encode block. Encoders compact kept values block by block into a preallocated array:
`np.compress` makes int64 positions of the kept weights (8 bytes each), and for a 4096x14336 matrix those
are 470 MB streamed through memory; a block's mask, values and positions (about 4 MB at most) stay in
cache instead. Read at call time so that tests can shrink it to exercise many blocks on small shapes."""


def blocks(count: int, weights_each: int) -> Iterator[tuple[int, int]]:
    """[first, last) ranges over `count` items (rows, tiles) of `weights_each` weights, about
    ENCODE_BLOCK weights per range and at least one item."""
    per_block = max(1, ENCODE_BLOCK // max(weights_each, 1))
    for first in range(0, count, per_block):
        yield first, min(first + per_block, count)


def encode_threads() -> int:
    """Threads the encoders use: `$SPARSE_FORMATS_THREADS`, else min(8, CPU count)."""
    configured = os.environ.get(THREADS_ENV, "").strip()
    if configured:
        if not configured.isdigit() or int(configured) < 1:
            raise ValueError(f"{THREADS_ENV} must be a positive integer, got {configured!r}")
        return int(configured)
    return min(8, os.cpu_count() or 1)


def in_parallel(work: Callable[[tuple[int, int]], None], ranges: list[tuple[int, int]]) -> None:
    """Run `work` on each range on a small shared thread pool: numpy's packbits, compress, take and copies
    release the GIL, so independent row blocks use every core (about 1.45x on two cores)."""
    threads = encode_threads()
    if threads < 2 or len(ranges) < 2:
        for item in ranges:
            work(item)
        return
    if threads not in _POOLS:
        _POOLS[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sparse-formats")
    for _ in _POOLS[threads].map(work, ranges):  # re-raises the first worker exception here
        pass


def packed_words(keep: np.ndarray, row_multiple: int) -> np.ndarray:
    """A bool [rows, cols] mask as a little-endian row-packed bitmap of uint64 words, zero-padded to
    [rows rounded up to `row_multiple`, ceil(cols/64)]: bit c of word j is column 64j + c.

    Tiled layouts are 64 columns wide, so their bitmap words and per-tile counts (`np.bitwise_count`) come
    from this one `packbits` pass over the mask instead of a per-bit pass over a tile-ordered copy."""
    packed = np.packbits(keep, axis=1, bitorder="little")
    rows, row_bytes = packed.shape
    padded = np.zeros((-(-rows // row_multiple) * row_multiple, -(-row_bytes // 8) * 8), dtype=np.uint8)
    padded[:rows, :row_bytes] = packed
    return padded.view("<u8")


def exclusive_cumsum(counts: np.ndarray) -> np.ndarray:
    """int64 [n + 1]: 0, then the running totals of `counts` (where each block's values start)."""
    starts = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return starts
