"""Sparse formats: exact round trips (hypothesis), layouts against plain reference encoders written here,
byte sizes, and `check()` rejecting each kind of corruption with a message that names it."""

import math

import numpy as np
import pytest
import scipy.sparse
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparse_formats import FormatError, get_format, lossless_formats, nbytes

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
INT_VIEW = {2: torch.int16, 4: torch.int32}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(INT_VIEW[tensor.element_size()])


def random_case(rows: int, cols: int, density: float, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen).to(dtype)
    mask = torch.rand(rows, cols, generator=gen) < density
    weight.view(-1)[:: 7] = -0.0  # signed zeros must survive bit for bit, kept or not
    return weight, mask


def masked(weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The reference decode: kept values, +0.0 everywhere else."""
    return torch.where(mask, weight, torch.zeros((), dtype=weight.dtype))


@pytest.mark.parametrize("fmt_name", lossless_formats())
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 300), cols=st.integers(1, 200), density=st.floats(0.0, 1.0),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_round_trip_is_bit_exact(fmt_name, rows, cols, density, dtype, seed):
    fmt = get_format(fmt_name)
    weight, mask = random_case(rows, cols, density, dtype, seed)
    try:
        tensors = fmt.encode(weight, mask)
    except ValueError:
        if dtype == torch.float32 and fmt_name not in ("bitmap", "csr"):
            return  # tiled GPU layouts may hold 16-bit values only; test_tiled_csl_refuses_fp32 pins one
        raise
    assert tensors["shape"].dtype == torch.int64 and tensors["shape"].tolist() == [rows, cols]
    fmt.check(tensors)
    decoded = fmt.decode(tensors)
    assert decoded.dtype == dtype and decoded.shape == (rows, cols)
    assert torch.equal(bits(decoded), bits(masked(weight, mask)))


def test_bitmap_layout_matches_a_plain_encoder():
    weight, mask = random_case(37, 29, 0.45, torch.float16, seed=1)
    tensors = get_format("bitmap").encode(weight, mask)
    rows, cols = mask.shape
    expected_bitmap = np.zeros((rows, math.ceil(cols / 8)), dtype=np.uint8)
    expected_values, expected_offsets = [], []
    for r in range(rows):
        expected_offsets.append(len(expected_values))
        for c in range(cols):
            if mask[r, c]:
                expected_bitmap[r, c // 8] |= 1 << (c % 8)
                expected_values.append(weight[r, c])
    assert np.array_equal(tensors["bitmap"].numpy(), expected_bitmap)
    assert torch.equal(bits(tensors["values"]), bits(torch.stack(expected_values)))
    assert tensors["row_offsets"].dtype == torch.int64 and tensors["row_offsets"].tolist() == expected_offsets


def test_csr_layout_matches_scipy():
    weight, mask = random_case(41, 33, 0.3, torch.float32, seed=2)
    tensors = get_format("csr").encode(weight, mask)
    reference = scipy.sparse.csr_matrix(mask.numpy())
    assert tensors["col_indices"].dtype == torch.int32 and tensors["row_ptr"].dtype == torch.int64
    assert np.array_equal(tensors["row_ptr"].numpy(), reference.indptr)
    assert np.array_equal(tensors["col_indices"].numpy(), reference.indices)
    expected_values = torch.stack([weight[r, c] for r, c in mask.nonzero().tolist()])
    assert torch.equal(bits(tensors["values"]), bits(expected_values))


def flash_llm_no_reorder(weight: torch.Tensor, mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """Flash-LLM's InitSparseMatrixA_API_NoReorder written out plainly, tile by tile and position by position,
    on the zero-padded matrix (kept = mask, padding at the first not-kept positions)."""
    rows, cols = mask.shape
    raw = weight.view(torch.int16)
    tile_rows, tile_cols = math.ceil(rows / 128), math.ceil(cols / 64)
    words, offsets, total = [], [0], 0
    for i in range(tile_rows):
        for j in range(tile_cols):
            cells = [(m, n) for m in range(128) for n in range(64)]
            kept = [(i * 128 + m < rows and j * 64 + n < cols and bool(mask[i * 128 + m, j * 64 + n]))
                    for m, n in cells]
            padding = (4 - sum(kept) % 4) % 4
            for (m, n), is_kept in zip(cells, kept, strict=True):
                if is_kept or padding > 0:
                    if not is_kept:
                        padding -= 1
                    value = int(raw[i * 128 + m, j * 64 + n]) & 0xFFFF if is_kept else 0
                    position = m * 64 + (n ^ ((m % 8) << 3))
                    words.append((position << 16) | value)
                    total += 1
            offsets.append(total // 4)
    offsets.append(total // 4)
    return words, offsets


def test_tiled_csl_layout_matches_flash_llm_encoder():
    weight, mask = random_case(150, 70, 0.37, torch.float16, seed=3)
    tensors = get_format("tiled-csl").encode(weight, mask)
    words, offsets = flash_llm_no_reorder(weight, mask)
    assert tensors["words"].dtype == torch.int32 and tensors["tile_offsets"].dtype == torch.int32
    assert tensors["words"].tolist() == words
    assert tensors["tile_offsets"].tolist() == offsets


def test_tiled_csl_refuses_fp32():
    weight, mask = random_case(4, 4, 0.5, torch.float32, seed=0)
    with pytest.raises(ValueError, match="16-bit values"):
        get_format("tiled-csl").encode(weight, mask)


def test_byte_sizes():
    rows, cols = 130, 70
    weight, mask = random_case(rows, cols, 0.4, torch.bfloat16, seed=4)
    kept = int(mask.sum())
    assert nbytes(get_format("bitmap").encode(weight, mask)) == 16 + rows * 9 + 2 * kept + 8 * rows
    assert nbytes(get_format("csr").encode(weight, mask)) == 16 + 6 * kept + 8 * (rows + 1)
    words, offsets = flash_llm_no_reorder(weight, mask)
    assert nbytes(get_format("tiled-csl").encode(weight, mask)) == 16 + 4 * len(words) + 4 * len(offsets)


@pytest.mark.parametrize("fmt_name", lossless_formats())
def test_check_names_a_missing_tensor(fmt_name):
    fmt = get_format(fmt_name)
    weight, mask = random_case(20, 30, 0.5, torch.float16, seed=5)
    tensors = fmt.encode(weight, mask)
    for key in tensors:
        broken = {k: v for k, v in tensors.items() if k != key}
        with pytest.raises(FormatError, match=key):
            fmt.check(broken)


def corrupted(fmt_name: str, key: str, edit) -> dict[str, torch.Tensor]:
    weight, mask = random_case(150, 70, 0.5, torch.float16, seed=6)
    tensors = {k: v.clone() for k, v in get_format(fmt_name).encode(weight, mask).items()}
    tensors[key] = edit(tensors[key])
    return tensors


def set_item(index, value):
    def edit(tensor):
        tensor[index] = value
        return tensor
    return edit


CORRUPTIONS = [
    ("bitmap", "values", lambda t: t[:-1], "count mismatch"),
    ("bitmap", "row_offsets", lambda t: t[:-1], "one per row"),
    ("bitmap", "row_offsets", set_item(5, 0), "not monotone"),
    ("bitmap", "row_offsets", lambda t: t + (torch.arange(t.numel()) == 7), "row_offsets\\[7\\]"),
    ("bitmap", "bitmap", set_item((3, -1), 0xFF), "out of range"),
    ("bitmap", "bitmap", lambda t: t[:, :-1], "has shape"),
    ("bitmap", "shape", lambda t: t.int(), "dtype"),
    ("csr", "col_indices", set_item(10, 70), "out of range"),
    ("csr", "col_indices", lambda t: t[:-1], "count mismatch"),
    ("csr", "col_indices", lambda t: torch.cat([t[:1], t[:1], t[2:]]), "does not increase"),
    ("csr", "row_ptr", set_item(3, 10**6), "not monotone"),
    ("csr", "row_ptr", set_item(0, 1), "expected 0"),
    ("tiled-csl", "words", lambda t: t[:-4], "count mismatch"),
    ("tiled-csl", "words", set_item(0, (9000 << 16) | 1), "in-tile position 9000"),
    ("tiled-csl", "words", lambda t: torch.cat([t[:1], t[:1], t[2:]]), "two entries"),
    ("tiled-csl", "tile_offsets", set_item(2, 0), "not monotone"),
    ("tiled-csl", "tile_offsets", lambda t: t[:-1], "entries"),
]


@pytest.mark.parametrize(("fmt_name", "key", "edit", "message"), CORRUPTIONS,
                         ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CORRUPTIONS])
def test_check_rejects_corruption(fmt_name, key, edit, message):
    with pytest.raises(FormatError, match=message):
        get_format(fmt_name).check(corrupted(fmt_name, key, edit))


def test_tiled_csl_rejects_a_value_outside_the_shape():
    # 150 rows: the second row tile holds rows 128..255, so in-tile row 30 is row 158, past the shape.
    weight, mask = random_case(150, 70, 0.5, torch.float16, seed=7)
    tensors = get_format("tiled-csl").encode(weight, mask)
    first_of_tile_2 = int(tensors["tile_offsets"][2]) * 4
    tensors["words"][first_of_tile_2] = ((30 * 64) << 16) | 0x3C00  # 1.0 at in-tile (30, 0)
    with pytest.raises(FormatError, match="out of range for shape 150x70"):
        get_format("tiled-csl").check(tensors)
