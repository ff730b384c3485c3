"""The `tiled-csl` format: Flash-LLM's Tiled-CSL layout (Xia et al., VLDB 2024), the layout its SpMM
kernel loads tile by tile into shared memory.

Layout, as Flash-LLM's `InitSparseMatrixA_API_NoReorder` writes it, for a [rows, cols] weight (M x K):
- The weight is cut into tiles of 128 rows x 64 columns, numbered row-major over the tile grid:
  tile t = (row tile i, column tile j) with t = i * ceil(cols/64) + j. Flash-LLM requires M % 128 == 0 and
  K % 64 == 0; here edge tiles are padded with zeros, and positions past the shape are never kept.
- `words`: int32 [4 * tile_offsets[-1]], one 32-bit word per stored entry, tiles one after the other, and
  within a tile the entries in row-major order of (row r, column c) in the tile. Low 16 bits: the raw bits
  of the 16-bit value; high 16 bits: the in-tile position r * 64 + (c XOR ((r % 8) << 3)) - Flash-LLM's
  column swizzle that makes the shared-memory writes bank-conflict free.
- Padding: each tile's entry count is rounded up to a multiple of 4 (the kernel reads 4 words at a time,
  one uint4) with zero-valued entries at the tile's first not-kept positions in row-major order,
  interleaved in scan order as Flash-LLM does. Flash-LLM picks zero positions by value; here by mask, so
  a kept weight whose value is 0 still counts as kept.
- `tile_offsets`: int32 [n_tiles + 2], in units of 4 words: tile t holds
  words[4*tile_offsets[t] : 4*tile_offsets[t+1]]; entry 0 is 0 and the last entry repeats the total
  (Flash-LLM's "N+1 offsets + 1 padding", an empty tile at the end).
- `value_dtype`: an empty tensor whose dtype names how to read the 16-bit values. Flash-LLM is fp16 only;
  bf16 weights are stored as their raw bf16 bits (a bf16 kernel reads them the same way). 32-bit weights
  do not fit the word and are refused: cast to fp16 or bf16 first.
- `shape`: int64[2].

Flash-LLM's default encoder (`InitSparseMatrixA_API`) additionally permutes entries inside a tile to
balance shared-memory banks; positions are explicit, so that permutation changes only the order of
words within a tile, and this module keeps the plain scan order. Four bytes per kept weight: no saving
at 50% sparsity over dense fp16."""

import numpy as np
import torch

from sparse_formats.base import register
from sparse_formats.checks import (
    blocks,
    check_encode_inputs,
    check_offsets_order,
    exclusive_cumsum,
    first_index,
    from_raw_bits,
    in_parallel,
    packed_words,
    raw_bits,
    read_shape,
    require,
    shape_tensor,
)
from sparse_formats.errors import FormatError

TILE_ROWS = 128
TILE_COLS = 64
TILE_SIZE = TILE_ROWS * TILE_COLS
VECTOR = 4  # words per uint4 load
VALUE_DTYPES = (torch.float16, torch.bfloat16)
PROBE = TILE_COLS  # padding positions are looked for in each tile's first row before the whole tile


def _grid(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // TILE_ROWS), -(-cols // TILE_COLS)


def _tile_order(band: np.ndarray) -> np.ndarray:
    """A [128, n*64] slice of one tile row -> a new [n, 8192] array, each tile row-major (always a copy,
    even where a view would do: the encoder writes padding into it)."""
    tiles = band.reshape(TILE_ROWS, -1, TILE_COLS).transpose(1, 0, 2)
    return np.array(tiles, copy=True).reshape(-1, TILE_SIZE)


def _swizzle(position: np.ndarray) -> np.ndarray:
    """Row-major in-tile position <-> Flash-LLM's stored position (the XOR is its own inverse)."""
    row = position >> 6
    return (row << 6) | ((position & (TILE_COLS - 1)) ^ ((row & 7) << 3))


# The swizzle of every in-tile position, looked up instead of recomputed (a 32 KiB table stays in L1).
SWIZZLE = _swizzle(np.arange(TILE_SIZE, dtype=np.int32))
SWIZZLE_HIGH = SWIZZLE << 16  # as it sits in a word, for the encoder


def _padding_positions(kept: np.ndarray, padding: np.ndarray) -> np.ndarray:
    """Bool [n_tiles, 8192]: each tile's first `padding[t]` not-kept positions in row-major order.
    Most tiles find them in their first row; only the others pay for a scan of the whole tile."""
    chosen = np.zeros_like(kept)
    probe_free = ~kept[:, :PROBE]
    probe_rank = np.cumsum(probe_free, axis=1, dtype=np.int16)
    chosen[:, :PROBE] = probe_free & (probe_rank <= padding[:, None])
    short = np.flatnonzero(probe_rank[:, -1] < padding)
    if short.size:
        free = ~kept[short]
        rank = np.cumsum(free, axis=1, dtype=np.int16)
        chosen[short] = free & (rank <= padding[short, None])
    return chosen


def _encode_tiles(kept: np.ndarray, bits: np.ndarray, padding: np.ndarray, out: np.ndarray) -> None:
    """Words of a block of tiles (bool and int16 [n, 8192] in tile order, `bits` a scratch copy) into
    `out`: kept entries and each tile's zero padding in row-major order, swizzled position high, value
    bits low. Padding is zeroed in the block before the gather, one pass over cached data."""
    padded = _padding_positions(kept, padding)
    np.copyto(bits, 0, where=padded)  # padding entries hold zero, whatever the pruned weight was
    stored = np.flatnonzero(kept | padded)
    values = bits.reshape(-1).take(stored).view(np.uint16)
    np.bitwise_or(SWIZZLE_HIGH[stored & (TILE_SIZE - 1)], values, out=out)


class TiledCslFormat:
    name = "tiled-csl"
    lossless = True

    def encode(self, weight: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Tile counts (hence padding and offsets) come from one `packbits` of the mask: a tile is 128
        rows of one 64-bit word each. Words are then built a block of tiles at a time (one tile row,
        `ENCODE_BLOCK` weights of column tiles), each block put in tile order in cache and written at its
        precomputed offset, instead of reordering the whole matrix and its int64 positions first; tile rows
        run on the shared thread pool."""
        check_encode_inputs(weight, mask)
        if weight.dtype not in VALUE_DTYPES:
            raise ValueError(f"tiled-csl stores 16-bit values (float16 or bfloat16), got {weight.dtype}; "
                             f"cast the weight first")
        rows, cols = weight.shape
        tile_rows, tile_cols = _grid(rows, cols)
        keep, bits = mask.contiguous().numpy(), raw_bits(weight)
        row_words = packed_words(keep, TILE_ROWS).reshape(tile_rows, TILE_ROWS, tile_cols)
        counts = np.bitwise_count(row_words).sum(axis=1, dtype=np.int64).reshape(-1)
        padding = ((-counts) % VECTOR).astype(np.int16)
        starts = exclusive_cumsum((counts + padding) // VECTOR)
        if (rows, cols) != (tile_rows * TILE_ROWS, tile_cols * TILE_COLS):
            pad_to = ((0, tile_rows * TILE_ROWS - rows), (0, tile_cols * TILE_COLS - cols))
            keep, bits = np.pad(keep, pad_to), np.pad(bits, pad_to)
        words = np.empty(VECTOR * starts[-1], dtype=np.int32)

        def encode_bands(bands: tuple[int, int]) -> None:
            for ti in range(*bands):
                band = slice(ti * TILE_ROWS, (ti + 1) * TILE_ROWS)
                for first, last in blocks(tile_cols, TILE_SIZE):
                    span = slice(first * TILE_COLS, last * TILE_COLS)
                    tiles = slice(ti * tile_cols + first, ti * tile_cols + last)
                    first_word, last_word = VECTOR * starts[tiles.start], VECTOR * starts[tiles.stop]
                    _encode_tiles(_tile_order(keep[band, span]), _tile_order(bits[band, span]),
                                  padding[tiles], out=words[first_word:last_word])

        in_parallel(encode_bands, [(ti, ti + 1) for ti in range(tile_rows)])
        offsets = np.concatenate([starts, starts[-1:]]).astype(np.int32)
        return {
            "shape": shape_tensor(weight),
            "words": torch.from_numpy(words),
            "tile_offsets": torch.from_numpy(offsets),
            "value_dtype": torch.empty(0, dtype=weight.dtype),
        }

    def decode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        rows, cols = read_shape(tensors, self.name)
        grid = _grid(rows, cols)
        keys, bits = _unpack(tensors, grid)
        tiles = np.zeros((grid[0] * grid[1], TILE_SIZE), dtype=np.int16)
        tiles.reshape(-1)[keys] = bits
        dense = tiles.reshape(grid[0], grid[1], TILE_ROWS, TILE_COLS).transpose(0, 2, 1, 3)
        dense = dense.reshape(grid[0] * TILE_ROWS, grid[1] * TILE_COLS)[:rows, :cols]
        return from_raw_bits(np.ascontiguousarray(dense), tensors["value_dtype"].dtype)

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        rows, cols = read_shape(tensors, self.name)
        words = require(tensors, self.name, "words", torch.int32, 1)
        offsets = require(tensors, self.name, "tile_offsets", torch.int32, 1)
        marker = require(tensors, self.name, "value_dtype")
        if marker.dtype not in VALUE_DTYPES:
            raise FormatError(f"tiled-csl: value_dtype is {marker.dtype}, expected float16 or bfloat16")
        grid = _grid(rows, cols)
        n_tiles = grid[0] * grid[1]
        if offsets.numel() != n_tiles + 2:
            raise FormatError(f"tiled-csl: tile_offsets has {offsets.numel()} entries, {n_tiles} tiles need "
                              f"{n_tiles + 2}")
        check_offsets_order(self.name, "tile_offsets", offsets, "tile")
        if int(offsets[-1]) != int(offsets[-2]):
            raise FormatError("tiled-csl: the last tile_offsets entry must repeat the total "
                              "(Flash-LLM's padding entry)")
        if words.numel() != VECTOR * int(offsets[-1]):
            raise FormatError(f"tiled-csl: tile_offsets account for {VECTOR * int(offsets[-1])} words but "
                              f"words holds {words.numel()} (count mismatch)")
        entries = offsets[1:-1] - offsets[:-2]
        if bool((entries > TILE_SIZE // VECTOR).any()):
            tile = first_index(entries > TILE_SIZE // VECTOR)
            raise FormatError(f"tiled-csl: tile {tile} holds more entries than its {TILE_SIZE} positions")
        raw_positions = (words.numpy() >> 16) & 0xFFFF
        if (raw_positions >= TILE_SIZE).any():
            at = int(np.argmax(raw_positions >= TILE_SIZE))
            raise FormatError(f"tiled-csl: words[{at}] has in-tile position {int(raw_positions[at])}, "
                              f"out of range for a {TILE_ROWS}x{TILE_COLS} tile")
        keys, bits = _unpack(tensors, grid)
        tile_ids, positions = keys >> 13, keys & (TILE_SIZE - 1)
        row = (tile_ids // grid[1]) * TILE_ROWS + (positions >> 6)
        col = (tile_ids % grid[1]) * TILE_COLS + (positions & (TILE_COLS - 1))
        outside = ((row >= rows) | (col >= cols)) & (bits != 0)
        if outside.any():
            at = int(np.argmax(outside))
            raise FormatError(f"tiled-csl: words[{at}] puts a value at ({int(row[at])}, {int(col[at])}), "
                              f"out of range for shape {rows}x{cols}")
        occupied = np.zeros(n_tiles * TILE_SIZE, dtype=bool)
        occupied[keys] = True
        if np.count_nonzero(occupied) != keys.size:
            first_seen = np.zeros(n_tiles * TILE_SIZE, dtype=np.int64)
            np.add.at(first_seen, keys, 1)
            key = int(np.argmax(first_seen > 1))
            raise FormatError(f"tiled-csl: tile {key // TILE_SIZE} has two entries at in-tile position "
                              f"{key % TILE_SIZE}")


def _unpack(tensors: dict[str, torch.Tensor], grid: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """(tile id * 8192 + row-major in-tile position, raw int16 value bits) of every stored word."""
    words, offsets = tensors["words"].numpy(), tensors["tile_offsets"].numpy().astype(np.int64)
    n_tiles = grid[0] * grid[1]
    per_tile = (offsets[1 : n_tiles + 1] - offsets[:n_tiles]) * VECTOR
    tile_ids = np.repeat(np.arange(n_tiles, dtype=np.int64), per_tile)
    keys = (tile_ids << 13) | SWIZZLE[(words >> 16) & (TILE_SIZE - 1)]
    return keys, (words & 0xFFFF).astype(np.int16)


TILED_CSL = register(TiledCslFormat())
