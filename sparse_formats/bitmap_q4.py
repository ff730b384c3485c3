"""`bitmap-q4`: the `bitmap` layout with each kept value stored as a 4-bit code and a scale per group.

Two grids, both with `code` in 0..15 and `scale` one fp16 per row and group of `group_size` consecutive
input columns, as in GPTQ or Q4_0:
- symmetric: a kept weight is `scale * (code - 7.5)`: 16 levels around zero without a zero level (a kept
  weight is rarely near zero: pruning removed the small ones);
- asymmetric (the layout has `zeros`): `scale * (code - zero)` with an integer zero point 0..15 per row
  and group, as GPTQ's asymmetric grid: the 16 levels span the group's own range, which halves the 4-bit
  cost where a group's weights lean to one side (bench/results/quality_grid_smollm2-135m.md).

Tensors for a [rows, cols] weight (cols a multiple of the group size, the group size a multiple of 32):
- `shape`: int64[2].
- `bitmap`: uint8 [rows, cols/8], as in `bitmap` (bit j of byte b is column 8b+j).
- `codes`: uint8 [n]: for each row, for each 32-column word in order, ceil(popcount/2) bytes; the k-th
  kept weight of the word is in byte k/2, the low nibble for even k, the high one for odd k. A word
  with an odd count leaves its last high nibble zero: every word starts on a byte, so a kernel reads a
  word's codes without a nibble shift (the padding costs 1/128 byte per weight).
- `scales`: fp16 [rows, cols/group_size]; the group size is `cols / scales.shape[1]`.
- `row_offsets`: int32 [rows], byte index in `codes` of each row's first word (int32: a layer's codes
  would need over 4 billion weights to overflow it, and 4 bytes less per row count on small models).
- `zeros` (asymmetric grid only): uint8 [rows, ceil(groups/2)], group g's zero point in byte g/2, the low
  nibble for even g (an odd group count leaves the last high nibble zero).

Bytes per weight at the default group of 64: 0.125 (bitmap) + kept/2 and padding + 2/64 (scales), and
0.5/64 for the zero points; at 50% sparsity about 0.41 (0.42 asymmetric), at 60% about 0.36 (0.37)
(`bytes_per_weight`)."""

import numpy as np
import torch

from sparse_formats.base import register
from sparse_formats.bitpack import packed_cols
from sparse_formats.checks import (
    POPCOUNT,
    blocks,
    check_encode_inputs,
    check_offsets_order,
    first_index,
    in_parallel,
    read_shape,
    require,
)
from sparse_formats.errors import FormatError

LEVELS = 16
GRID_OFFSET = 7.5  # value = scale * (code - GRID_OFFSET)
WORD = 32  # columns per bitmap word; groups are whole words
DEFAULT_GROUP_SIZE = 64
FP16_MAX = 65504.0


def grid() -> torch.Tensor:
    """The 16 levels (code - 7.5) as fp32; exact in bf16 and fp16 too."""
    return torch.arange(LEVELS, dtype=torch.float32) - GRID_OFFSET


def check_group_size(cols: int, group_size: int) -> None:
    """ValueError unless `group_size` is a positive multiple of 32 that divides `cols`."""
    if group_size <= 0 or group_size % WORD:
        raise ValueError(f"group size must be a positive multiple of {WORD}, got {group_size}")
    if cols % group_size:
        raise ValueError(f"group size {group_size} does not divide the {cols} input columns")


def absmax_scales(weight: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """fp16 [rows, cols/group_size]: the largest kept |w| of each group maps to the outermost level."""
    check_group_size(weight.shape[1], group_size)
    kept = torch.where(mask, weight.float().abs(), torch.zeros(()))
    top = kept.view(weight.shape[0], -1, group_size).amax(dim=-1)
    if bool((top / GRID_OFFSET > FP16_MAX).any()):
        raise ValueError(f"a kept weight of {float(top.max()):.3g} needs a scale beyond fp16's range")
    return (top / GRID_OFFSET).to(torch.float16)


def grid_offset(zeros: torch.Tensor | None, cols: int) -> torch.Tensor | float:
    """What each code is offset by: 7.5 on the symmetric grid, else each group's zero point spread over
    its columns (fp32 [rows, cols]; `zeros` uint8 [rows, groups])."""
    if zeros is None:
        return GRID_OFFSET
    return zeros.float().repeat_interleave(cols // zeros.shape[1], dim=1)


def quantize_codes(weight: torch.Tensor, scales: torch.Tensor,
                   zeros: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 codes [rows, cols] of the nearest level for every weight (kept or not) under `scales` (and the
    zero points `zeros` [rows, groups] of the asymmetric grid); a zero scale gives code 0 (the symmetric
    grid; any code decodes to 0 there) or the zero point."""
    rows, cols = weight.shape
    group_size = cols // scales.shape[1]
    scale = scales.float().repeat_interleave(group_size, dim=1)
    safe = torch.where(scale > 0, scale, torch.ones(()))
    offset = grid_offset(zeros, cols)
    codes = torch.round(weight.float() / safe + offset).clamp_(0, LEVELS - 1)
    at_zero = torch.zeros(()) if zeros is None else offset
    return torch.where(scale > 0, codes, at_zero).to(torch.uint8)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, mask: torch.Tensor,
               zeros: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [rows, cols]: scale * (code - 7.5), or scale * (code - zero) with `zeros` [rows, groups], where
    kept, +0.0 elsewhere; exact in fp32 (an fp16 scale times an integer or half-integer below 16 needs at
    most 16 significant bits)."""
    group_size = codes.shape[1] // scales.shape[1]
    scale = scales.float().repeat_interleave(group_size, dim=1)
    offset = grid_offset(None if zeros is None else zeros.to(codes.device), codes.shape[1])
    values = scale * (codes.float() - offset)
    return torch.where(mask, values, torch.zeros((), device=values.device))


def pack_zeros(zeros: torch.Tensor) -> torch.Tensor:
    """The stored `zeros` (uint8 [rows, ceil(groups/2)], two per byte) from one byte per group."""
    rows, groups = zeros.shape
    padded = torch.zeros(rows, groups + groups % 2, dtype=torch.uint8, device=zeros.device)
    padded[:, :groups] = zeros
    return (padded[:, 0::2] | (padded[:, 1::2] << 4)).contiguous()


def unpack_zeros(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """One byte per group (uint8 [rows, groups]) from the stored `zeros`."""
    both = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    return both[:, :groups].contiguous()


def _word_counts(bitmap: np.ndarray) -> np.ndarray:
    """Kept weights per 32-column word: [rows, cols/32]."""
    return np.bitwise_count(bitmap.view("<u4")).astype(np.int64)


def bytes_per_weight(rows: int, cols: int, kept_per_word: np.ndarray | None = None, sparsity: float = 0.5,
                     group_size: int = DEFAULT_GROUP_SIZE, zero_points: bool = False) -> float:
    """Stored bytes per weight, every tensor counted (`zero_points`: the asymmetric grid's); from actual
    word counts when given, else the expectation for a uniformly random mask at `sparsity`."""
    words = rows * cols // WORD
    if kept_per_word is None:
        density = 1.0 - sparsity
        k = np.arange(WORD + 1)
        from math import comb
        p = np.array([comb(WORD, i) * density**i * (1 - density) ** (WORD - i) for i in k])
        code_bytes = words * float((p * ((k + 1) // 2)).sum())
    else:
        code_bytes = float(((kept_per_word + 1) // 2).sum())
    total = 16 + rows * cols / 8 + code_bytes + 2 * rows * cols / group_size + 4 * rows
    if zero_points:
        total += rows * -(-cols // group_size // 2)
    return total / (rows * cols)


class BitmapQ4Format:
    name = "bitmap-q4"
    lossless = False  # values are rounded to the grid; round trips are exact for codes and scales

    def encode(self, weight: torch.Tensor, mask: torch.Tensor, scales: torch.Tensor | None = None,
               group_size: int = DEFAULT_GROUP_SIZE,
               zeros: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Quantize the kept weights to the nearest level. With `scales` (fp16 [rows, groups]), and `zeros`
        (uint8 [rows, groups]) for the asymmetric grid, the kept weights must already lie on that grid (a
        quantized run folder): ValueError names the first one that does not, so an export can never
        differ from its run. Without, scales are absmax ones on the symmetric grid."""
        check_encode_inputs(weight, mask)
        rows, cols = weight.shape
        given = scales is not None
        if scales is None:
            if zeros is not None:
                raise ValueError("zero points need the scales they were chosen with")
            scales = absmax_scales(weight, mask, group_size)
        else:
            if scales.dim() != 2 or scales.shape[0] != rows or scales.shape[1] == 0:
                raise ValueError(f"scales have shape {tuple(scales.shape)}, expected [{rows}, groups]")
            check_group_size(cols, cols // scales.shape[1] if cols % scales.shape[1] == 0 else 0)
            scales = scales.to(torch.float16)
            if zeros is not None and (tuple(zeros.shape) != tuple(scales.shape) or zeros.dtype != torch.uint8
                                      or bool((zeros >= LEVELS).any())):
                raise ValueError(f"zero points must be uint8 0..{LEVELS - 1} shaped as the scales "
                                 f"{tuple(scales.shape)}, got {zeros.dtype} {tuple(zeros.shape)}")
        codes = quantize_codes(weight, scales, zeros)
        if given:
            off = mask & (dequantize(codes, scales, mask, zeros) != weight.float())
            if bool(off.any()):
                row, col = (int(i) for i in off.nonzero()[0])
                raise ValueError(f"kept weight [{row}, {col}] = {float(weight[row, col])!r} is not on the "
                                 f"grid of its scale {float(scales[row, col * scales.shape[1] // cols])!r}")
        return self.pack(codes, scales, mask, zeros)

    def pack(self, codes: torch.Tensor, scales: torch.Tensor, mask: torch.Tensor,
             zeros: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The stored tensors from dense codes [rows, cols] (only kept positions are stored), fp16 scales,
        the mask and, for the asymmetric grid, one zero point per group (uint8 [rows, groups]); blocks of
        rows are packed on the encoder thread pool."""
        rows, cols = mask.shape
        check_group_size(cols, cols // max(scales.shape[1], 1) if scales.shape[1] else 0)
        keep = mask.contiguous().numpy()
        code = codes.contiguous().numpy()
        bitmap = np.packbits(keep, axis=1, bitorder="little")
        word_bytes = (_word_counts(bitmap) + 1) // 2
        row_bytes = word_bytes.sum(axis=1)
        starts = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(row_bytes, out=starts[1:])
        if starts[-1] > np.iinfo(np.int32).max:
            raise ValueError(f"{starts[-1]} bytes of codes overflow the int32 row offsets")
        packed = np.zeros(starts[-1], dtype=np.uint8)

        def pack_block(block: tuple[int, int]) -> None:
            first, last = block
            words = keep[first:last].reshape(-1, WORD)
            rank = np.cumsum(words, axis=1, dtype=np.int64) - 1
            word_start = np.zeros(words.shape[0], dtype=np.int64)
            np.cumsum(word_bytes[first:last].reshape(-1)[:-1], out=word_start[1:])
            where = words.reshape(-1)
            byte = (word_start[:, None] + rank // 2).reshape(-1)[where]
            high = (rank % 2 == 1).reshape(-1)[where]
            value = code[first:last].reshape(-1)[where]
            out = packed[starts[first]:starts[last]]
            out[byte[~high]] = value[~high]
            out[byte[high]] |= value[high] << 4

        in_parallel(pack_block, list(blocks(rows, cols)))
        tensors = {
            "shape": torch.tensor([rows, cols], dtype=torch.int64),
            "bitmap": torch.from_numpy(bitmap),
            "codes": torch.from_numpy(packed),
            "scales": scales.to(torch.float16).contiguous(),
            "row_offsets": torch.from_numpy(starts[:-1].astype(np.int32)),
        }
        if zeros is not None:
            tensors["zeros"] = pack_zeros(zeros.to(torch.uint8))
        return tensors

    @staticmethod
    def zero_points(tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The asymmetric grid's zero points, one byte per group (uint8 [rows, groups]); None: symmetric."""
        if "zeros" not in tensors:
            return None
        return unpack_zeros(tensors["zeros"], tensors["scales"].shape[1])

    def unpack(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes uint8 [rows, cols], zero where pruned; scales fp16; mask bool) from the stored tensors,
        in torch on their device, so that serving can decode on a GPU too."""
        rows, cols = (int(v) for v in tensors["shape"].tolist())
        bitmap, packed = tensors["bitmap"], tensors["codes"]
        device = bitmap.device
        bits = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=device)
        mask = ((bitmap.unsqueeze(-1) & bits) != 0).view(rows, -1)[:, :cols]
        words = mask.reshape(rows, -1, WORD)
        counts = words.sum(dim=-1)
        word_bytes = (counts + 1) // 2
        word_start = word_bytes.reshape(-1).cumsum(0) - word_bytes.reshape(-1)
        rank = words.cumsum(dim=-1) - 1
        byte = (word_start.view(rows, -1, 1) + rank // 2).view(rows, cols)
        shift = ((rank % 2) * 4).view(rows, cols).to(torch.uint8)
        codes = torch.zeros((rows, cols), dtype=torch.uint8, device=device)
        if packed.numel():
            codes[mask] = (packed[byte[mask]] >> shift[mask]) & 0xF
        return codes, tensors["scales"], mask

    def decode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The dequantized masked weight in fp32."""
        codes, scales, mask = self.unpack(tensors)
        return dequantize(codes, scales, mask, self.zero_points(tensors))

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        rows, cols = read_shape(tensors, self.name)
        bitmap = require(tensors, self.name, "bitmap", torch.uint8, 2)
        codes = require(tensors, self.name, "codes", torch.uint8, 1)
        scales = require(tensors, self.name, "scales", torch.float16, 2)
        offsets = require(tensors, self.name, "row_offsets", torch.int32, 1)
        if scales.shape[0] != rows or scales.shape[1] == 0 or cols % scales.shape[1] \
                or (cols // scales.shape[1]) % WORD:
            raise FormatError(f"{self.name}: scales have shape {tuple(scales.shape)}; a {rows}x{cols} weight "
                              f"needs [{rows}, cols/group] with a group of whole 32-column words")
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            row = first_index((~torch.isfinite(scales) | (scales < 0)).any(dim=1))
            raise FormatError(f"{self.name}: scales row {row} holds a negative or non-finite scale")
        if "zeros" in tensors:
            zeros = require(tensors, self.name, "zeros", torch.uint8, 2)
            groups = scales.shape[1]
            if tuple(zeros.shape) != (rows, (groups + 1) // 2):
                raise FormatError(f"{self.name}: zeros have shape {tuple(zeros.shape)}; {groups} groups of "
                                  f"{rows} rows need [{rows}, {(groups + 1) // 2}] (two zero points a byte)")
            if groups % 2 and rows and bool((zeros[:, -1] >> 4 != 0).any()):
                row = first_index(zeros[:, -1] >> 4 != 0)
                raise FormatError(f"{self.name}: zeros row {row} has a nonzero padding nibble after its last "
                                  f"group")
        if tuple(bitmap.shape) != (rows, packed_cols(cols)):
            raise FormatError(f"{self.name}: bitmap has shape {tuple(bitmap.shape)}, a {rows}x{cols} weight "
                              f"needs {(rows, packed_cols(cols))}")
        per_byte = POPCOUNT[bitmap.long()]
        word_counts = per_byte.view(rows, -1, 4).sum(dim=-1)
        word_bytes = (word_counts + 1) // 2
        row_bytes = word_bytes.sum(dim=1)
        if offsets.numel() != rows:
            raise FormatError(f"{self.name}: row_offsets has {offsets.numel()} entries, expected {rows} "
                              f"(one per row)")
        if codes.numel() != int(row_bytes.sum()):
            raise FormatError(f"{self.name}: the bitmap's {int(word_counts.sum())} kept weights need "
                              f"{int(row_bytes.sum())} bytes of codes, codes holds {codes.numel()} "
                              f"(bitmap/code count mismatch)")
        if rows == 0:
            return
        check_offsets_order(self.name, "row_offsets", offsets.long(), "row")
        expected = row_bytes.cumsum(0) - row_bytes
        if not torch.equal(offsets.long(), expected):
            row = first_index(offsets.long() != expected)
            raise FormatError(f"{self.name}: row_offsets[{row}] is {int(offsets[row])}, but the bitmap puts "
                              f"that row's first code at byte {int(expected[row])}")
        odd = (word_counts % 2 == 1).reshape(-1)
        if bool(odd.any()):
            ends = (word_bytes.reshape(-1).cumsum(0) - 1)[odd]
            loose = (codes[ends] >> 4) != 0
            if bool(loose.any()):
                byte = int(ends[first_index(loose)])
                raise FormatError(f"{self.name}: codes byte {byte} ends a word with an odd count but its "
                                  f"padding nibble is not zero")


BITMAP_Q4 = register(BitmapQ4Format())
