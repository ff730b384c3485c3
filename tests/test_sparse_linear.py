"""The sparse linear op and the compressed weight slicing that tensor-parallel loading uses, against
plainly written references: a dense masked matmul and numpy's little-endian bit packing."""

import numpy as np
import pytest
import torch

from serving.sparse_linear import BitmapWeight, bitmap_linear

MANTISSA_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


def random_sparse(rows: int, cols: int, density: float, dtype=torch.float32, seed: int = 0):
    """A dense weight, its keep-mask, and the bitmap triple built with numpy (an independent packer)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen).to(dtype)
    mask = torch.rand(rows, cols, generator=gen) < density
    bitmap = torch.from_numpy(np.packbits(mask.numpy(), axis=1, bitorder="little"))
    values = weight[mask]  # boolean indexing walks row-major, the order the format keeps values in
    counts = mask.sum(dim=1)
    row_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)[:-1]])
    return weight, mask, BitmapWeight(bitmap, values, row_offsets, cols)


def excess_error(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias) -> float:
    """How far the worst output lies beyond its rounding bound (<= 0: within): per output one rounding of
    x W^T and one of the result to the output dtype, plus the fp32 summation bound K * 2^-23 * sum |x w|
    (the bound of tests/test_cpu_kernel.py). A per-output bound, not one scaled by the largest output: a
    kept weight dropped from one sum must not hide under the other outputs' size."""
    product = x.double() @ dense.double().T
    expected = product + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ dense.double().abs().T
    ulp = 2.0 ** (1 - MANTISSA_BITS[got.dtype])
    bound = ulp * (expected.abs() + product.abs()) + dense.shape[1] * 2.0 ** -23 * magnitude + 1e-30
    return ((got.double() - expected).abs() - bound).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(16, 64), (37, 173), (5, 3)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bitmap_linear_equals_dense_masked_matmul(dtype, shape, with_bias):
    rows, cols = shape
    weight, mask, packed = random_sparse(rows, cols, 0.5, dtype)
    x = torch.randn(2, 7, cols).to(dtype)
    bias = torch.randn(rows).to(dtype) if with_bias else None
    got = bitmap_linear(x, packed.bitmap, packed.values, packed.row_offsets, cols, bias)
    assert got.shape == (2, 7, rows) and got.dtype == dtype
    assert excess_error(got, x, weight * mask, bias) <= 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_bound_catches_a_kept_weight_zeroed(dtype):
    """Issue 20: main's bf16 tolerance (2e-2 x the largest output x sqrt(K)) passed this fault. Zeroing the
    largest kept weight changes each output of its row by |x w|, many roundings of the result."""
    weight, mask, packed = random_sparse(37, 173, 0.5, dtype)
    x = torch.randn(2, 7, 173).to(dtype)
    values = packed.values.clone()
    values[values.float().abs().argmax()] = 0
    got = bitmap_linear(x, packed.bitmap, values, packed.row_offsets, 173)
    assert excess_error(got, x, weight * mask, None) > 0


@pytest.mark.parametrize("density", [0.0, 1.0])
def test_bitmap_linear_empty_and_full(density):
    weight, mask, packed = random_sparse(9, 20, density)
    x = torch.randn(3, 20)
    torch.testing.assert_close(bitmap_linear(x, packed.bitmap, packed.values, packed.row_offsets, 20),
                               x @ (weight * mask).T)


def test_bitmap_linear_is_a_registered_op_with_a_fake_impl():
    _, _, packed = random_sparse(12, 30, 0.4)
    x = torch.randn(4, 30)
    torch.library.opcheck(bitmap_linear, (x, packed.bitmap, packed.values, packed.row_offsets, 30),
                          test_utils=("test_schema", "test_faketensor"))


def test_bitmap_linear_stays_one_opaque_call_under_torch_compile():
    weight, mask, packed = random_sparse(12, 30, 0.4)

    def layer(x):
        return torch.relu(bitmap_linear(x, packed.bitmap, packed.values, packed.row_offsets, 30))

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    for batch in (3, 5):
        x = torch.randn(batch, 30)
        torch.testing.assert_close(compiled(x), torch.relu(x @ (weight * mask).T))


def test_decode_is_the_masked_weight():
    weight, mask, packed = random_sparse(23, 45, 0.3)
    assert torch.equal(packed.dense(), weight * mask)
    assert torch.equal(packed.mask(), mask)


@pytest.mark.parametrize("start,stop", [(0, 23), (0, 7), (7, 23), (11, 12)])
def test_slice_rows_matches_dense_rows(start, stop):
    weight, mask, packed = random_sparse(23, 45, 0.5)
    part = packed.slice_rows(start, stop)
    assert torch.equal(part.dense(), (weight * mask)[start:stop])
    counts = mask[start:stop].sum(dim=1)
    assert torch.equal(part.row_offsets, counts.cumsum(0) - counts)


@pytest.mark.parametrize("start,stop", [(0, 45), (0, 22), (22, 45), (3, 11), (40, 45)])
def test_slice_cols_repacks_bitmap_values_and_offsets(start, stop):
    weight, mask, packed = random_sparse(23, 45, 0.5)
    part = packed.slice_cols(start, stop)
    sub_mask = mask[:, start:stop]
    numpy_bits = np.packbits(sub_mask.numpy(), axis=1, bitorder="little")
    assert torch.equal(part.bitmap, torch.from_numpy(numpy_bits))
    assert torch.equal(part.values, weight[:, start:stop][sub_mask])
    counts = sub_mask.sum(dim=1)
    assert torch.equal(part.row_offsets, counts.cumsum(0) - counts)
    assert part.n_cols == stop - start
    assert torch.equal(part.dense(), (weight * mask)[:, start:stop])


def test_cat_rows_stacks_shards():
    parts = [random_sparse(rows, 30, 0.5, seed=rows) for rows in (8, 4, 4)]
    stacked = BitmapWeight.cat_rows([p[2] for p in parts])
    assert torch.equal(stacked.dense(), torch.cat([w * m for w, m, _ in parts]))
    counts = torch.cat([m for _, m, _ in parts]).sum(dim=1)
    assert torch.equal(stacked.row_offsets, counts.cumsum(0) - counts)


def test_csr_tensors_convert_to_the_same_weight():
    weight, mask, packed = random_sparse(17, 29, 0.5)
    rows_idx, cols_idx = mask.nonzero(as_tuple=True)  # row-major, columns increasing within a row
    counts = mask.sum(dim=1)
    csr = {"shape": torch.tensor([17, 29]), "values": weight[rows_idx, cols_idx],
           "col_indices": cols_idx.to(torch.int32),
           "row_ptr": torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])}
    converted = BitmapWeight.from_tensors("csr", csr)
    assert torch.equal(converted.bitmap, packed.bitmap)
    assert torch.equal(converted.values, packed.values)
    assert torch.equal(converted.row_offsets, packed.row_offsets)


def test_corrupt_tensors_are_refused_at_load():
    _, _, packed = random_sparse(10, 16, 0.5)
    tensors = {"shape": torch.tensor([10, 16]), "bitmap": packed.bitmap, "values": packed.values[:-1],
               "row_offsets": packed.row_offsets}
    with pytest.raises(ValueError, match="count mismatch"):
        BitmapWeight.from_tensors("bitmap", tensors)


def test_compressed_weight_is_smaller_than_dense_at_half_density():
    """At 50% sparsity: fp32 values take 2 of 4 bytes per weight and the bitmap 1/8 byte."""
    _, _, packed = random_sparse(256, 512, 0.5)
    dense_bytes = 256 * 512 * 4
    assert packed.nbytes() <= 0.6 * dense_bytes
    expected = packed.values.numel() * 4 + 256 * 512 // 8 + 256 * 8
    assert packed.nbytes() == expected


def test_tiled_bitmap_op_wraps_the_gpu_kernel_package():
    """The op vLLM layers call on CUDA; on CPU the kernel package decodes, which checks the plumbing
    (names, tensor order, fake shape) that the GPU path shares."""
    from serving.sparse_linear import tiled_bitmap_linear, tiled_kernel
    from sparse_formats import get_format

    if tiled_kernel() is None:
        pytest.skip("serving.kernels.tiled_bitmap_triton is not importable (no triton)")
    weight, mask, _ = random_sparse(70, 130, 0.5)
    tiled = get_format("tiled-bitmap").encode(weight, mask)
    x, bias = torch.randn(3, 130), torch.randn(70)
    args = (x, list(tiled.values()), ",".join(tiled), 70, bias)
    torch.testing.assert_close(tiled_bitmap_linear(*args), x @ (weight * mask).T + bias)
    torch.library.opcheck(tiled_bitmap_linear, args, test_utils=("test_schema", "test_faketensor"))
