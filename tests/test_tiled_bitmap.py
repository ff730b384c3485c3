"""The `tiled-bitmap` format: exact round trips, the documented layout, byte counts and corruption checks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_formats import FormatError, get_format, nbytes

FMT = get_format("tiled-bitmap")
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32}


def _problem(rows: int, cols: int, density: float, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=generator).to(dtype)
    mask = torch.rand(rows, cols, generator=generator) < density
    return weight, mask


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_SAME_SIZE_INT[t.element_size()])


def _naive_encoding(weight: torch.Tensor, mask: torch.Tensor):
    """The layout as the module docstring states it, element by element."""
    rows, cols = weight.shape
    row_groups, col_groups = -(-rows // 64), -(-cols // 64)
    words = [[[0] * 64 for _ in range(col_groups)] for _ in range(row_groups)]
    values, offsets = [], [0]
    for gi in range(row_groups):
        for gj in range(col_groups):
            for r in range(64):
                for c in range(64):
                    row, col = 64 * gi + r, 64 * gj + c
                    if row < rows and col < cols and mask[row, col]:
                        words[gi][gj][r] |= 1 << c
                        values.append(weight[row, col])
            offsets.append(len(values))
    signed = [[[w - (1 << 64) if w >= 1 << 63 else w for w in row] for row in group] for group in words]
    return torch.tensor(signed, dtype=torch.int64).view(row_groups, col_groups, 64), values, offsets


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 150), cols=st.integers(0, 150), density=st.floats(0.0, 1.0),
       dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**31 - 1))
def test_round_trip_is_bit_exact(rows, cols, density, dtype, seed):
    weight, mask = _problem(rows, cols, density, dtype, seed)
    weight[0:1, 0:3] = torch.tensor([float("nan"), -0.0, float("-inf")])[: min(cols, 3)].to(dtype)
    tensors = FMT.encode(weight, mask)
    FMT.check(tensors)
    decoded = FMT.decode(tensors)
    expected = torch.where(mask, weight, torch.zeros((), dtype=dtype))
    assert decoded.dtype == dtype and decoded.shape == (rows, cols)
    assert torch.equal(_bits(decoded), _bits(expected))
    assert tensors["values"].numel() == int(mask.sum())


def test_layout_matches_the_documented_one():
    weight, mask = _problem(70, 130, 0.5, torch.float16, seed=11)
    mask[5, 63] = True  # bit 63: the word's sign bit
    tensors = FMT.encode(weight, mask)
    words, values, offsets = _naive_encoding(weight, mask)
    assert torch.equal(tensors["bitmap"], words)
    assert torch.equal(_bits(tensors["values"]), _bits(torch.stack(values)))
    assert tensors["group_offsets"].tolist() == offsets
    assert tensors["shape"].tolist() == [70, 130]


@pytest.mark.parametrize(("density", "dtype"),
                         [(0.5, torch.float16), (0.4, torch.bfloat16), (0.3, torch.float32)])
def test_bytes_per_weight(density, dtype):
    """1 bit per weight of the padded groups, the kept values, 8 bytes per group offset, 16 for the shape."""
    weight, mask = _problem(256, 320, density, dtype, seed=12)
    tensors = FMT.encode(weight, mask)
    groups = 4 * 5
    expected = groups * 64 * 8 + int(mask.sum()) * weight.element_size() + (groups + 1) * 8 + 16
    assert nbytes(tensors) == expected


def test_encode_rejects_mismatched_mask():
    with pytest.raises(ValueError, match="same shape"):
        FMT.encode(torch.zeros(4, 5), torch.zeros(4, 6, dtype=torch.bool))


def _valid() -> dict[str, torch.Tensor]:
    weight, mask = _problem(100, 90, 0.5, torch.float16, seed=13)
    return FMT.encode(weight, mask)


def _flip_bit(tensors, group, row, col):
    bitmap = tensors["bitmap"].clone()
    bitmap.view(-1, 64)[group, row] ^= torch.tensor(1, dtype=torch.int64) << col
    return {**tensors, "bitmap": bitmap}


@settings(max_examples=25, deadline=None)
@given(group=st.integers(0, 3), row=st.integers(0, 63), col=st.integers(0, 63))
def test_check_catches_a_flipped_bit(group, row, col):
    """Any single flipped bit either lands outside the matrix or breaks its group's count."""
    with pytest.raises(FormatError, match="outside the 100x90 matrix|bits set but group_offsets"):
        FMT.check(_flip_bit(_valid(), group, row, col))


@settings(max_examples=25, deadline=None)
@given(group=st.integers(1, 3), delta=st.integers(1, 50))
def test_check_catches_an_edited_offset(group, delta):
    tensors = _valid()
    offsets = tensors["group_offsets"].clone()
    offsets[group] += delta
    with pytest.raises(FormatError, match="decrease at group|bits set but group_offsets"):
        FMT.check({**tensors, "group_offsets": offsets})


@pytest.mark.parametrize(("corrupt", "message"), [
    (lambda t: {k: v for k, v in t.items() if k != "values"}, "missing tensor"),
    (lambda t: {**t, "values": t["values"][:-1]}, "run from 0 to the"),
    (lambda t: {**t, "bitmap": t["bitmap"][:, :1]}, "bitmap must be int64"),
    (lambda t: {**t, "bitmap": t["bitmap"].to(torch.int32)}, "bitmap must be int64"),
    (lambda t: {**t, "group_offsets": t["group_offsets"][:-1]}, "group_offsets must be int64"),
    (lambda t: {**t, "shape": torch.tensor([100, 80])}, "outside the 100x80 matrix"),
    (lambda t: {**t, "shape": torch.tensor([100, 200])}, "bitmap must be int64"),
    (lambda t: {**t, "shape": torch.tensor([-1, 90])}, "non-negative"),
    (lambda t: {**t, "values": t["values"].to(torch.int16)}, "1-D float"),
], ids=["missing", "truncated-values", "bitmap-shape", "bitmap-dtype", "offsets-length", "shape-narrower",
        "shape-wider", "shape-negative", "values-dtype"])
def test_check_names_what_is_wrong(corrupt, message):
    with pytest.raises(FormatError, match=message):
        FMT.check(corrupt(_valid()))


def test_check_catches_a_stray_bit_past_the_last_column():
    tensors = _flip_bit(_valid(), group=1, row=0, col=90 - 64)  # column 90 of a 90-column matrix
    with pytest.raises(FormatError, match=r"outside the 100x90 matrix \(row 0, column 90\)"):
        FMT.check(tensors)
