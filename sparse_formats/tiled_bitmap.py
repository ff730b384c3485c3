"""The `tiled-bitmap` format: the layout the GPU kernel (`serving/kernels/tiled_bitmap_triton.py`) streams.

SpInfer cuts a weight into 64x64 groups of 8x8 bitmap tiles. Here a group keeps the 64x64 size but its
bitmap words are 1x64 row strips, because that is what a Triton decode GEMV expands cheaply: one word per
row of the group, the input vector x broadcasts along rows, and the position of a kept value inside its
group is a prefix sum (cumsum along the row, plus an exclusive cumsum of the row counts down the group)
computed in registers. 8x8 tiles would need a register permutation that Triton can only do through shared
memory. Each group's 64 words are adjacent in memory (512 bytes, one coalesced load) and its values are
one contiguous slice, so a program reads every byte of its groups once.

Layout for a weight of shape [N, K] (rows = output features), with NG = ceil(N/64), KG = ceil(K/64):

- `shape`: int64[2] = [N, K].
- `bitmap`: int64 [NG, KG, 64]. Word [gi, gj, r] covers row 64*gi + r and columns 64*gj .. 64*gj + 63;
  bit c (least significant first) is column 64*gj + c. Bits of rows >= N and columns >= K are zero.
  (int64 holds the bit pattern; torch has no full uint64 support.)
- `values`: [nnz] in the weight's dtype: kept values group by group (group index gi*KG + gj), row-major
  inside a group.
- `group_offsets`: int64 [NG*KG + 1]: index in `values` of each group's first value; the last entry is nnz.

Bytes per weight: 1/8 (bitmap) + density * value size + 8/4096 (offsets), e.g. fp16 at 50% density 1.127
(dense 2.0), at 40% density 0.927. Padding only adds zero words for partial edge groups.
"""

import numpy as np
import torch

from sparse_formats.base import register
from sparse_formats.checks import blocks, exclusive_cumsum, in_parallel, packed_words, raw_bits
from sparse_formats.errors import FormatError

GROUP = 64
_KEYS = ("shape", "bitmap", "values", "group_offsets")
_BITS_IN_BYTE = np.array([bin(b).count("1") for b in range(256)], dtype=np.int64)
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _groups(n: int) -> int:
    return (n + GROUP - 1) // GROUP


def _to_group_order(dense: torch.Tensor) -> np.ndarray:
    """[N, K] -> flat array of the zero-padded [NG, KG, 64, 64] blocks, each group's block contiguous.

    Floats travel as same-size integers so that numpy moves bf16 (and every NaN payload) bit for bit."""
    rows, cols = dense.shape
    ng, kg = _groups(rows), _groups(cols)
    if dense.dtype.is_floating_point:
        dense = dense.view(_SAME_SIZE_INT[dense.element_size()])
    array = dense.cpu().numpy()
    if (rows, cols) != (ng * GROUP, kg * GROUP):
        array = np.pad(array, ((0, ng * GROUP - rows), (0, kg * GROUP - cols)))
    return np.ascontiguousarray(array.reshape(ng, GROUP, kg, GROUP).transpose(0, 2, 1, 3)).reshape(-1)


def _group_order(band: np.ndarray) -> np.ndarray:
    """A [64, n*64] slice of one row group -> its n groups one after the other, each row-major (flat)."""
    return band.reshape(GROUP, -1, GROUP).transpose(1, 0, 2).reshape(-1)


def _unpack_group_mask(bitmap: torch.Tensor) -> np.ndarray:
    """int64 [NG, KG, 64] -> flat bool in group order (bit c of word r is row r, column c of the group)."""
    as_bytes = bitmap.cpu().contiguous().numpy().view(np.uint8)  # little-endian: byte b = columns 8b..8b+7
    return np.unpackbits(as_bytes.reshape(-1), bitorder="little").view(bool)


def _group_counts(bitmap: torch.Tensor) -> np.ndarray:
    ng, kg = bitmap.shape[:2]
    as_bytes = bitmap.cpu().contiguous().numpy().view(np.uint8)
    return _BITS_IN_BYTE[as_bytes].reshape(ng * kg, GROUP * 8).sum(axis=1)


class TiledBitmapFormat:
    name = "tiled-bitmap"
    lossless = True

    def encode(self, weight: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """A group's 64 words are bytes 8gj..8gj+7 of its 64 rows in the row-packed bitmap, so the bitmap
        and the group counts come from one `packbits` of the mask. Values are compacted a block of groups
        at a time (one row group, `ENCODE_BLOCK` weights of column groups), each block put in group order
        in cache and written at its precomputed offset, instead of reordering the whole matrix first; row
        groups run on the shared thread pool."""
        if weight.dim() != 2 or mask.shape != weight.shape:
            raise ValueError(f"weight must be 2-D and mask the same shape, got {tuple(weight.shape)} "
                             f"and {tuple(mask.shape)}")
        rows, cols = weight.shape
        ng, kg = _groups(rows), _groups(cols)
        keep = mask.to(torch.bool).cpu().contiguous().numpy()
        words = packed_words(keep, GROUP).reshape(ng, GROUP, kg).transpose(0, 2, 1)
        words = np.ascontiguousarray(words)
        offsets = exclusive_cumsum(np.bitwise_count(words).sum(axis=2, dtype=np.int64).reshape(-1))
        bits = raw_bits(weight.cpu())
        if (rows, cols) != (ng * GROUP, kg * GROUP):
            padding = ((0, ng * GROUP - rows), (0, kg * GROUP - cols))
            keep, bits = np.pad(keep, padding), np.pad(bits, padding)
        values = np.empty(offsets[-1], dtype=bits.dtype)

        def compact(bands: tuple[int, int]) -> None:
            for gi in range(*bands):
                band = slice(gi * GROUP, (gi + 1) * GROUP)
                for first, last in blocks(kg, GROUP * GROUP):
                    span = slice(first * GROUP, last * GROUP)
                    np.compress(_group_order(keep[band, span]), _group_order(bits[band, span]),
                                out=values[offsets[gi * kg + first]:offsets[gi * kg + last]])

        in_parallel(compact, [(gi, gi + 1) for gi in range(ng)])
        device = weight.device
        return {"shape": torch.tensor([rows, cols], dtype=torch.int64),
                "bitmap": torch.from_numpy(words.view(np.int64)).to(device),
                "values": torch.from_numpy(values).view(weight.dtype).to(device),
                "group_offsets": torch.from_numpy(offsets).to(device)}

    def decode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        rows, cols = (int(v) for v in tensors["shape"])
        values = tensors["values"]
        bitmap = tensors["bitmap"]
        ng, kg = bitmap.shape[:2]
        as_int = values.cpu().view(_SAME_SIZE_INT[values.element_size()]).numpy()
        grouped = np.zeros(ng * kg * GROUP * GROUP, dtype=as_int.dtype)
        grouped[np.flatnonzero(_unpack_group_mask(bitmap))] = as_int  # about 2x faster than np.place
        dense = torch.from_numpy(grouped).view(ng, kg, GROUP, GROUP).permute(0, 2, 1, 3)
        dense = dense.reshape(ng * GROUP, kg * GROUP)[:rows, :cols].contiguous()
        return dense.view(values.dtype).to(values.device)

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        missing = [k for k in _KEYS if k not in tensors]
        if missing:
            raise FormatError(f"tiled-bitmap: missing tensor(s) {', '.join(missing)}")
        shape, bitmap, values, offsets = (tensors[k] for k in _KEYS)
        if shape.dtype != torch.int64 or shape.shape != (2,) or bool((shape < 0).any()):
            raise FormatError(f"tiled-bitmap: shape must be two non-negative int64, got {shape.dtype} "
                              f"{shape.tolist()}")
        rows, cols = (int(v) for v in shape)
        ng, kg = _groups(rows), _groups(cols)
        if bitmap.dtype != torch.int64 or tuple(bitmap.shape) != (ng, kg, GROUP):
            raise FormatError(f"tiled-bitmap: bitmap must be int64 {[ng, kg, GROUP]} for shape "
                              f"{[rows, cols]}, got {bitmap.dtype} {list(bitmap.shape)}")
        if values.dim() != 1 or not values.dtype.is_floating_point:
            raise FormatError(f"tiled-bitmap: values must be a 1-D float tensor, got {values.dtype} "
                              f"{list(values.shape)}")
        if offsets.dtype != torch.int64 or tuple(offsets.shape) != (ng * kg + 1,):
            raise FormatError(f"tiled-bitmap: group_offsets must be int64 [{ng * kg + 1}], got "
                              f"{offsets.dtype} {list(offsets.shape)}")
        offsets = offsets.cpu()
        if int(offsets[0]) != 0 or int(offsets[-1]) != values.numel():
            raise FormatError(f"tiled-bitmap: group_offsets must run from 0 to the {values.numel()} values, "
                              f"got {int(offsets[0])} .. {int(offsets[-1])}")
        steps = offsets.diff()
        if bool((steps < 0).any()):
            group = int((steps < 0).nonzero()[0])
            raise FormatError(f"tiled-bitmap: group_offsets decrease at group {group} "
                              f"({int(offsets[group])} -> {int(offsets[group + 1])})")
        outside = ~_to_group_order(torch.ones(rows, cols, dtype=torch.bool))
        stray = np.flatnonzero(_unpack_group_mask(bitmap) & outside)
        if stray.size:
            gi, gj, r, c = np.unravel_index(stray[0], (ng, kg, GROUP, GROUP))
            raise FormatError(f"tiled-bitmap: bitmap has a bit set outside the {rows}x{cols} matrix "
                              f"(row {gi * GROUP + r}, column {gj * GROUP + c})")
        wrong = np.flatnonzero(_group_counts(bitmap) != steps.numpy())
        if wrong.size:
            group = int(wrong[0])
            raise FormatError(f"tiled-bitmap: group {group} (row group {group // kg}, column group "
                              f"{group % kg}) has {int(_group_counts(bitmap)[group])} bits set but "
                              f"group_offsets give it {int(steps[group])} values")


register(TiledBitmapFormat())


def masked_dense(weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """What decode returns: kept entries bit for bit, +0.0 elsewhere."""
    return torch.where(mask.to(torch.bool), weight, torch.zeros((), dtype=weight.dtype, device=weight.device))


__all__ = ["GROUP", "TiledBitmapFormat", "masked_dense"]
