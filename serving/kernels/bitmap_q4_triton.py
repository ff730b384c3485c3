"""y = x W^T (+ b) with W in `bitmap-q4` (4-bit codes of the kept weights, a scale per row and group, on the
asymmetric grid a zero point too; `sparse_formats/bitmap_q4.py`), in Triton, without a host synchronisation.

Why a layout of its own: the stored layout finds a row's codes through `row_offsets`, so a kernel reading a
block of rows would need one offset per row and 32-column word. `Q4Tiles` (made once at load, on the
weight's device, `Q4Tiles.from_stored`) cuts the weight into tiles of 64 rows x 32 columns (one bitmap word
per row) and puts each tile's words' codes one after the other, each word's as stored (whole bytes, low
nibble first), so a tile needs one offset: 4 bytes per 2048 weights. Scales (and zero points, two a byte)
are stored tile-major, [row tile, group, 64 rows], so a tile's 64 scales are one coalesced 128-byte load.
A tile is 32 columns so that every group size the format allows (any multiple of 32) covers whole tiles:
one scale per row and tile. Bytes per weight at 50% and groups of 64: 0.125 (bitmap) + 0.25 (codes) +
0.031 (scales) + 0.002 (tile offsets) = 0.41, against 0.53 for a dense int4 weight with groups of 128.

In the kernel, a tile's bitmap is [64 rows, 4 bytes]; for each byte the position of its first code is the
codes of earlier rows of the tile (a scan of 64 word sizes) plus those of earlier bytes of its word (a scan
of 4), and two aligned 32-bit loads bring its up to 8 codes into one 64-bit register, from which the eight
bit planes take theirs in turn (shift by 4 where the bit is set). The value is `code - offset` (offset 7.5,
or the group's zero point), exact in fp16/bf16; the scale multiplies after the sum over the tile's 32
columns, in fp32, so the kernel never rounds a weight.
- M = 1: the planes multiply x on the CUDA cores, fp32, one accumulator per row and byte.
- M = 2..16 (`Q4_KERNEL_MAX_M`): the planes are joined into a [64, 32] tile of `code - offset` for `tl.dot`
  (tensor cores, fp32 accumulation), scaled per row after each tile.
- Above: the weight is dequantised once per call (`q4_tiles_decode`, x's dtype) and multiplied by cuBLAS.
Split-K and the one-launch reduction are the tiled-bitmap kernel's (`tiled_bitmap_triton._finish`).

Nothing on the call path reads a device tensor on the host (shapes are Python ints in `Q4Tiles`), so CUDA
graphs capture it; `serving.kernels.sync_guard` is the check. On CPU tensors without `TRITON_INTERPRET=1`
the same functions dequantise in torch (the reference).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from serving.kernels.tiled_bitmap_triton import _INTERPRET, _finish, _on_triton, _split_k, _tickets
from sparse_formats import get_format, pack_rows
from sparse_formats.bitmap_q4 import GRID_OFFSET, WORD, check_group_size, unpack_zeros

ROWS = 64  # rows of a tile: one split-K ticket and one output block per row tile
Q4_KERNEL_MAX_M = 16  # up to this many rows of x the sparse kernels run; above, dequantise + cuBLAS
_CHUNK_WEIGHTS = 1 << 22  # weights converted at a time at load (bounds the int64 temporaries)
Q4 = get_format("bitmap-q4")


@triton.jit
def _popcount8(byte):
    """Bits set in each byte (SWAR: the interpreter has no popc)."""
    count = byte - ((byte >> 1) & 0x55)
    count = (count & 0x33) + ((count >> 2) & 0x33)
    return (count + (count >> 4)) & 0x0F


@triton.jit
def _tile_codes(words_ptr, codes_ptr, offsets_ptr, tile, ROWS: tl.constexpr):
    """A tile's bitmap as [ROWS, 4] bytes (byte b: columns 8b..8b+7 of the tile) and, per byte, its codes in
    column order from the lowest nibble of an int64 (two aligned 32-bit loads: at most 8 codes, starting at
    any nibble of the first word)."""
    rows = tl.arange(0, ROWS)
    byte_index = tl.arange(0, 4)
    word = tl.load(words_ptr + tile * ROWS + rows)
    byte = (word[:, None] >> (byte_index[None, :] * 8)) & 0xFF
    count = _popcount8(byte)
    word_bytes = (tl.sum(count, axis=1) + 1) >> 1
    row_start = tl.cumsum(word_bytes, axis=0) - word_bytes
    tile_start = tl.load(offsets_ptr + tile).to(tl.int64)
    nibble = 2 * (tile_start + row_start)[:, None] + (tl.cumsum(count, axis=1) - count)
    index = nibble >> 3
    shift = (nibble & 7) * 4
    kept = count > 0
    low = tl.load(codes_ptr + index, mask=kept, other=0)
    high = tl.load(codes_ptr + index + 1, mask=kept & (shift + 4 * count > 32), other=0)
    packed = (low.to(tl.int64) & 0xFFFFFFFF) | (high.to(tl.int64) << 32)
    return byte, packed >> shift


@triton.jit
def _group_params(scales_ptr, zeros_ptr, row_tile, group, groups, HAS_ZEROS: tl.constexpr,
                  ROWS: tl.constexpr):
    """The tile's 64 scales and offsets (7.5, or the zero points) in fp32."""
    rows = tl.arange(0, ROWS)
    scale = tl.load(scales_ptr + (row_tile * groups + group) * ROWS + rows).to(tl.float32)
    if HAS_ZEROS:
        pairs = (groups + 1) // 2
        zero = tl.load(zeros_ptr + (row_tile * pairs + group // 2) * ROWS + rows).to(tl.int32)
        offset = ((zero >> ((group & 1) * 4)) & 15).to(tl.float32)
    else:
        offset = tl.full((ROWS,), 7.5, tl.float32)
    return scale, offset


@triton.jit
def _plane(byte, packed, offset, J: tl.constexpr):
    """Column 8b + J of each byte: `code - offset` where kept (0 elsewhere), and the codes past it."""
    bit = (byte >> J) & 1
    value = tl.where(bit != 0, (packed & 15).to(tl.float32) - offset[:, None], 0.0)
    return value, packed >> (4 * bit)


@triton.jit
def _expand_tile(byte, packed, offset, ROWS: tl.constexpr):
    """The dense [ROWS, 32] tile of `code - offset` (fp32, zeros where pruned)."""
    w0, packed = _plane(byte, packed, offset, 0)
    w1, packed = _plane(byte, packed, offset, 1)
    w2, packed = _plane(byte, packed, offset, 2)
    w3, packed = _plane(byte, packed, offset, 3)
    w4, packed = _plane(byte, packed, offset, 4)
    w5, packed = _plane(byte, packed, offset, 5)
    w6, packed = _plane(byte, packed, offset, 6)
    w7, packed = _plane(byte, packed, offset, 7)
    # w{j}[r, b] is column 8b + j: join so that the three new axes spell j in binary, high bit first.
    tile = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
    return tl.reshape(tile, (ROWS, 32))


@triton.jit
def _q4_gemv_kernel(x_ptr, words_ptr, codes_ptr, offsets_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
                    partial_ptr, ticket_ptr, N, col_tiles, tiles_per_split, n_splits, groups, group_tiles,
                    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr):
    """One token: per tile, the eight planes multiply x on the CUDA cores (fp32), summed per row and byte,
    then scaled; the sum over bytes happens once, after the loop."""
    row_tile = tl.program_id(0)
    split = tl.program_id(1)
    byte_index = tl.arange(0, 4)
    acc = tl.zeros((ROWS, 4), dtype=tl.float32)
    first = split * tiles_per_split
    for col_tile in range(first, tl.minimum(first + tiles_per_split, col_tiles)):
        byte, packed = _tile_codes(words_ptr, codes_ptr, offsets_ptr, row_tile * col_tiles + col_tile, ROWS)
        scale, offset = _group_params(scales_ptr, zeros_ptr, row_tile, col_tile // group_tiles, groups,
                                      HAS_ZEROS, ROWS)
        ks = col_tile * 32 + byte_index * 8
        part = tl.zeros((ROWS, 4), dtype=tl.float32)
        for j in tl.static_range(8):
            value, packed = _plane(byte, packed, offset, j)
            part += value * tl.load(x_ptr + ks + j).to(tl.float32)[None, :]
        acc += part * scale[:, None]
    ns = row_tile * ROWS + tl.arange(0, ROWS)
    _finish(tl.sum(acc, axis=1)[None, :], tl.arange(0, 1), ns, 1, N, bias_ptr, out_ptr, 0, partial_ptr,
            ticket_ptr + row_tile, split, n_splits, HAS_BIAS)


@triton.jit
def _q4_mm_kernel(x_ptr, words_ptr, codes_ptr, offsets_ptr, scales_ptr, zeros_ptr, bias_ptr, out_ptr,
                  partial_ptr, ticket_ptr, M, N, col_tiles, tiles_per_split, n_splits, groups, group_tiles,
                  stride_xm, stride_om, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, DOT_IN_FP32: tl.constexpr, ROWS: tl.constexpr):
    """2..16 tokens: each tile of `code - offset` (exact in x's dtype) goes through `tl.dot`, fp32
    accumulation, and is scaled per row after it."""
    row_tile = tl.program_id(0)
    split = tl.program_id(1)
    ms = tl.arange(0, BLOCK_M)
    lanes = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, ROWS), dtype=tl.float32)
    first = split * tiles_per_split
    for col_tile in range(first, tl.minimum(first + tiles_per_split, col_tiles)):
        byte, packed = _tile_codes(words_ptr, codes_ptr, offsets_ptr, row_tile * col_tiles + col_tile, ROWS)
        scale, offset = _group_params(scales_ptr, zeros_ptr, row_tile, col_tile // group_tiles, groups,
                                      HAS_ZEROS, ROWS)
        w = _expand_tile(byte, packed, offset, ROWS)
        ks = col_tile * 32 + lanes
        x = tl.load(x_ptr + ms[:, None] * stride_xm + ks[None, :], mask=ms[:, None] < M, other=0.0)
        if DOT_IN_FP32:  # the interpreter (numpy has no bf16) and fp32 models
            part = tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(w.to(x.dtype)))
        acc += part * scale[None, :]
    ns = row_tile * ROWS + tl.arange(0, ROWS)
    _finish(acc, ms, ns, M, N, bias_ptr, out_ptr, stride_om, partial_ptr, ticket_ptr + row_tile, split,
            n_splits, HAS_BIAS)


@triton.jit
def _q4_decode_kernel(words_ptr, codes_ptr, offsets_ptr, scales_ptr, zeros_ptr, out_ptr, N, K, col_tiles,
                      groups, group_tiles, HAS_ZEROS: tl.constexpr, ROWS: tl.constexpr):
    """The dequantised tile, scale * (code - offset) rounded once to the output's dtype."""
    row_tile = tl.program_id(0)
    col_tile = tl.program_id(1)
    byte, packed = _tile_codes(words_ptr, codes_ptr, offsets_ptr, row_tile * col_tiles + col_tile, ROWS)
    scale, offset = _group_params(scales_ptr, zeros_ptr, row_tile, col_tile // group_tiles, groups,
                                  HAS_ZEROS, ROWS)
    w = _expand_tile(byte, packed, offset, ROWS) * scale[:, None]
    ns = row_tile * ROWS + tl.arange(0, ROWS)
    ks = col_tile * 32 + tl.arange(0, 32)
    tl.store(out_ptr + ns[:, None] * K + ks[None, :], w.to(out_ptr.dtype.element_ty), mask=ns[:, None] < N)


@dataclass
class Q4Tiles:
    """A bitmap-q4 weight in the kernel's tile-major layout (module docstring), on one device.

    `words`: int32 [row tiles, col tiles, 64], bit c of word r is column 32 * col_tile + c of row
    64 * row_tile + r; `codes`: int32 view of the bytes (padded so that a load of the word after the last is
    in bounds); `tile_offsets`: int32 [tiles], byte of each tile's first code; `scales`: fp16 [row tiles,
    groups, 64]; `zeros`: uint8 [row tiles, ceil(groups / 2), 64], group g's zero point in the low nibble
    for even g, None on the symmetric grid. Rows past `n_rows` are pruned."""

    words: torch.Tensor
    codes: torch.Tensor
    tile_offsets: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    n_rows: int
    n_cols: int
    group_size: int

    NAMES = ("words", "codes", "tile_offsets", "scales", "zeros")

    def tensors(self) -> list[torch.Tensor]:
        """The tensors an op call passes (`from_tensors` takes them back)."""
        return [getattr(self, name) for name in self.NAMES if getattr(self, name) is not None]

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor], n_rows: int, n_cols: int,
                     group_size: int) -> "Q4Tiles":
        zeros = tensors[4] if len(tensors) > 4 else None
        return cls(*tensors[:4], zeros, n_rows, n_cols, group_size)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @classmethod
    def from_dense(cls, codes: torch.Tensor, mask: torch.Tensor, scales: torch.Tensor,
                   zeros: torch.Tensor | None = None) -> "Q4Tiles":
        """From dense codes (uint8 [rows, cols], only kept positions read), the keep-mask, fp16 scales
        [rows, groups] and, on the asymmetric grid, one zero point per group (uint8 [rows, groups])."""
        rows, cols = mask.shape
        check_group_size(cols, cols // max(scales.shape[1], 1))
        chunk = max(ROWS, _CHUNK_WEIGHTS // max(cols, 1) // ROWS * ROWS)
        parts = [_tile_chunk(codes[start:start + chunk], mask[start:start + chunk])
                 for start in range(0, rows, chunk)]
        return cls._assemble(parts, scales, zeros, rows, cols)

    @classmethod
    def from_stored(cls, tensors: dict[str, torch.Tensor]) -> "Q4Tiles":
        """From a weight's stored bitmap-q4 tensors (`shape` on the CPU, the rest on the target device),
        decoded a block of rows at a time on that device (host syncs here are load time only)."""
        rows, cols = (int(v) for v in tensors["shape"].tolist())
        scales, offsets = tensors["scales"], tensors["row_offsets"].long()
        chunk = max(ROWS, _CHUNK_WEIGHTS // max(cols, 1) // ROWS * ROWS)
        parts = []
        for start in range(0, rows, chunk):
            stop = min(start + chunk, rows)
            first = int(offsets[start])
            last = int(offsets[stop]) if stop < rows else tensors["codes"].numel()
            block = {"shape": torch.tensor([stop - start, cols]), "bitmap": tensors["bitmap"][start:stop],
                     "codes": tensors["codes"][first:last], "scales": scales[start:stop],
                     "row_offsets": offsets[start:stop] - first}
            codes, _, mask = Q4.unpack(block)
            parts.append(_tile_chunk(codes, mask))
        zeros = Q4.zero_points(tensors)
        return cls._assemble(parts, scales, zeros, rows, cols)

    @classmethod
    def _assemble(cls, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], scales: torch.Tensor,
                  zeros: torch.Tensor | None, rows: int, cols: int) -> "Q4Tiles":
        device = scales.device
        row_tiles, groups = triton.cdiv(rows, ROWS), scales.shape[1]
        if parts:
            words = torch.cat([p[0] for p in parts])
            data = torch.cat([p[1] for p in parts])
            tile_bytes = torch.cat([p[2] for p in parts])
        else:
            words = torch.zeros(0, cols // WORD, ROWS, dtype=torch.int32, device=device)
            data = tile_bytes = torch.zeros(0, dtype=torch.int64, device=device)
        if data.numel() >= 2**31:
            raise ValueError(f"{data.numel()} bytes of codes overflow the int32 tile offsets")
        offsets = (tile_bytes.cumsum(0) - tile_bytes).to(torch.int32)
        padded = torch.zeros(triton.cdiv(data.numel(), 4) * 4 + 8, dtype=torch.uint8, device=device)
        padded[:data.numel()] = data
        tiled_scales = _tile_major(scales.to(torch.float16), row_tiles)
        tiled_zeros = None
        if zeros is not None:
            per_group = _tile_major(zeros.to(torch.uint8), row_tiles)
            per_group = F.pad(per_group, (0, 0, 0, groups % 2))
            tiled_zeros = (per_group[:, 0::2] | (per_group[:, 1::2] << 4)).contiguous()
        return cls(words.contiguous(), padded.view(torch.int32), offsets, tiled_scales, tiled_zeros, rows,
                   cols, cols // groups)


def _tile_major(per_group: torch.Tensor, row_tiles: int) -> torch.Tensor:
    """[rows, groups] -> [row tiles, groups, 64], rows past the last padded with zeros."""
    rows, groups = per_group.shape
    padded = F.pad(per_group, (0, 0, 0, row_tiles * ROWS - rows))
    return padded.view(row_tiles, ROWS, groups).permute(0, 2, 1).contiguous()


def _tile_chunk(codes: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block of rows: (words int32 [row tiles, col tiles, 64], the code bytes in tile order, bytes per
    tile); each word's codes as stored (ceil(kept / 2) bytes, the k-th kept weight in byte k / 2, the low
    nibble for even k)."""
    rows, cols = mask.shape
    pad = -rows % ROWS
    mask = F.pad(mask, (0, 0, 0, pad))
    codes = F.pad(codes, (0, 0, 0, pad))
    row_tiles, col_tiles = (rows + pad) // ROWS, cols // WORD
    words = pack_rows(mask).view(torch.int32).view(row_tiles, ROWS, col_tiles).permute(0, 2, 1)

    def tile_major(t: torch.Tensor) -> torch.Tensor:
        return t.view(row_tiles, ROWS, col_tiles, WORD).permute(0, 2, 1, 3).reshape(-1, WORD)

    keep, code = tile_major(mask), tile_major(codes)
    counts = keep.sum(dim=1)
    word_bytes = (counts + 1) // 2
    word_start = word_bytes.cumsum(0) - word_bytes
    rank = keep.cumsum(dim=1) - 1
    byte = word_start[:, None] + rank // 2
    data = torch.zeros(int(word_bytes.sum()), dtype=torch.uint8, device=mask.device)
    low, high = keep & (rank % 2 == 0), keep & (rank % 2 == 1)
    data[byte[low]] = code[low]
    data[byte[high]] |= code[high] << 4
    return words.contiguous(), data, word_bytes.view(-1, ROWS).sum(dim=1)


def q4_tiles_decode(tiles: Q4Tiles, dtype: torch.dtype) -> torch.Tensor:
    """The dequantised masked weight [rows, cols] in `dtype` (each value rounded once from fp32)."""
    if not _on_triton(tiles.codes):
        return _reference_dense(tiles).to(dtype)
    out = torch.empty(tiles.n_rows, tiles.n_cols, dtype=dtype, device=tiles.codes.device)
    row_tiles, col_tiles = tiles.words.shape[:2]
    if out.numel():
        _q4_decode_kernel[(row_tiles, col_tiles)](
            tiles.words, tiles.codes, tiles.tile_offsets, tiles.scales, _zeros_arg(tiles), out, tiles.n_rows,
            tiles.n_cols, col_tiles, tiles.scales.shape[1], tiles.group_size // WORD,
            HAS_ZEROS=tiles.zeros is not None, ROWS=ROWS)
    return out


def _zeros_arg(tiles: Q4Tiles) -> torch.Tensor:
    return tiles.zeros if tiles.zeros is not None else tiles.scales  # unread without zero points


def _reference_dense(tiles: Q4Tiles) -> torch.Tensor:
    """fp32 dense weight from the tiles in torch (CPU fallback; tests)."""
    row_tiles, col_tiles = tiles.words.shape[:2]
    rows, cols = row_tiles * ROWS, tiles.n_cols
    data = tiles.codes.view(torch.uint8)
    mask = torch.zeros(rows, cols, dtype=torch.bool, device=data.device)
    codes = torch.zeros(rows, cols, dtype=torch.uint8, device=data.device)
    words = tiles.words.permute(0, 2, 1).reshape(rows, col_tiles)
    bits = (words[..., None] >> torch.arange(WORD, device=data.device)) & 1
    keep = bits.bool().view(row_tiles, ROWS, col_tiles, WORD).permute(0, 2, 1, 3).reshape(-1, WORD)
    rank = keep.cumsum(dim=1) - 1
    counts = keep.sum(dim=1)
    word_bytes = (counts + 1) // 2
    byte = (word_bytes.cumsum(0) - word_bytes)[:, None] + rank // 2
    nibbles = (data[byte.clamp(min=0)].int() >> (4 * (rank % 2))) & 15
    tile_order = codes.view(row_tiles, ROWS, col_tiles, WORD).permute(0, 2, 1, 3)
    tile_order.copy_(torch.where(keep, nibbles, 0).view(row_tiles, col_tiles, ROWS, WORD).to(torch.uint8))
    mask.view(row_tiles, ROWS, col_tiles, WORD).permute(0, 2, 1, 3).copy_(keep.view(tile_order.shape))
    groups = tiles.scales.shape[1]
    scales = tiles.scales.permute(0, 2, 1).reshape(rows, groups).float()
    if tiles.zeros is None:
        offset = torch.full_like(scales, GRID_OFFSET)
    else:
        offset = unpack_zeros(tiles.zeros.permute(0, 2, 1).reshape(rows, -1), groups).float()
    per_col = tiles.group_size
    values = scales.repeat_interleave(per_col, 1) * (codes.float() - offset.repeat_interleave(per_col, 1))
    return torch.where(mask, values, 0.0)[:tiles.n_rows]


def _block_m(m: int) -> int:
    return 1 if m == 1 else 16


def q4_tiles_linear(x: torch.Tensor, tiles: Q4Tiles, bias: torch.Tensor | None = None, *,
                    split_k: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for x [..., K] (fp16, bf16 or fp32) and W in `tiles`; y [..., N] in x's dtype.

    The keyword-only arguments override the launch heuristics (tests and benchmark sweeps use them)."""
    rows, cols = tiles.n_rows, tiles.n_cols
    if x.shape[-1] != cols:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {cols}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cols)
    m = x2.shape[0]
    if not _on_triton(x2) or m > Q4_KERNEL_MAX_M:
        return F.linear(x, q4_tiles_decode(tiles, x.dtype), bias)
    if m == 0 or rows == 0 or cols == 0:
        y = x2.new_zeros(m, rows)
        return (y if bias is None else y + bias).reshape(*lead, rows)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    row_tiles, col_tiles = tiles.words.shape[:2]
    splits = split_k or _split_k(col_tiles, row_tiles, x2.device)
    tiles_per_split = triton.cdiv(col_tiles, splits)
    splits = triton.cdiv(col_tiles, tiles_per_split)
    y = torch.empty(m, rows, dtype=x.dtype, device=x.device)
    partial = torch.empty(splits if splits > 1 else 0, m, rows, dtype=torch.float32, device=x.device)
    operands = (x2, tiles.words, tiles.codes, tiles.tile_offsets, tiles.scales, _zeros_arg(tiles),
                y if bias is None else bias, y, partial, _tickets(x2.device, row_tiles))
    shape_args = (col_tiles, tiles_per_split, splits, tiles.scales.shape[1], tiles.group_size // WORD)
    flags = dict(HAS_ZEROS=tiles.zeros is not None, HAS_BIAS=bias is not None, ROWS=ROWS,
                 num_warps=num_warps or 4)
    if _block_m(m) == 1:
        _q4_gemv_kernel[(row_tiles, splits)](*operands, rows, *shape_args, **flags)
    else:
        _q4_mm_kernel[(row_tiles, splits)](
            *operands, m, rows, *shape_args, x2.stride(0), y.stride(0), BLOCK_M=_block_m(m),
            DOT_IN_FP32=_INTERPRET or x.dtype == torch.float32, **flags)
    return y.reshape(*lead, rows)


__all__ = ["Q4_KERNEL_MAX_M", "Q4Tiles", "q4_tiles_decode", "q4_tiles_linear"]
