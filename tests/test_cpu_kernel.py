"""The native CPU sparse linear op against the dense masked matmul computed plainly (float64), on every
instruction-set path this CPU runs (AVX-512 and AVX2 on the CI machines), every value dtype, 1 and 2
threads, M = 1..17, 24, 40 and 41 rows of x (the sparse kernels up to 40, decoded tiles and a dense GEMM
above),
odd column counts, empty and full rows, and tensor-parallel slices of a weight."""

import os

import numpy as np
import pytest
import torch
from kernel_helpers import REPO, X86_ONLY, assert_opaque_under_compile, assert_threads_agree, run_python

from serving import cpu_kernel
from serving.sparse_linear import BitmapWeight

pytestmark = X86_ONLY

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
MANTISSA_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}
# (rows, cols): columns not a multiple of 8/32/64, one column, no rows, a matrix wider than one fp32 tile
# of the many-rows kernels (8192 columns, so partial sums carry over between tiles), and rows not a
# multiple of 3 or 4 (the bf16 kernels' blocks).
SHAPES = [(37, 173), (5, 1), (0, 40), (13, 64), (9, 33), (6, 8300)]
DENSITIES = [0.0, 0.1, 0.5, 0.9, 1.0]


@pytest.fixture(scope="module")
def op():
    assert cpu_kernel.load(), cpu_kernel.unavailable_reason()  # an x86-64 machine with g++ must build it
    return torch.ops.leap_sparse_cpu.bitmap_linear


def sparse_weight(rows: int, cols: int, density: float, dtype: torch.dtype, seed: int = 0,
                  integers: bool = False):
    """(dense masked weight, BitmapWeight) with the bitmap packed by numpy (an independent packer). Row 1
    is kept whole and row 2 emptied, whatever the density, when the matrix has them."""
    gen = torch.Generator().manual_seed(seed)
    if integers:
        weight = torch.randint(0, 2, (rows, cols), generator=gen).float() * 2 - 1
    else:
        weight = torch.randn(rows, cols, generator=gen)
    weight = weight.to(dtype)
    mask = torch.rand(rows, cols, generator=gen) < density
    if rows > 2:
        mask[1], mask[2] = True, False
    packed = np.packbits(mask.numpy(), axis=1, bitorder="little")
    bitmap = torch.from_numpy(packed).reshape(rows, (cols + 7) // 8)
    counts = mask.sum(dim=1)
    offsets = counts.cumsum(0) - counts
    dense = torch.where(mask, weight, torch.zeros((), dtype=dtype))
    return dense, BitmapWeight(bitmap, weight[mask], offsets, cols)


def call(op, x, weight: BitmapWeight, bias=None):
    return op(x, weight.bitmap, weight.values, weight.row_offsets, weight.n_cols, bias)


def check_close(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias, what: str) -> None:
    """Per output: a rounding of x W^T and one of the result to the output dtype (above 40 rows the
    dense GEMM may round the product before adding the bias), the fp32 summation bound
    K * 2^-23 * sum |x w|, and the dtype's subnormal spacing."""
    product = x.double() @ dense.double().T
    expected = product + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ dense.double().abs().T
    ulp = 2.0 ** (1 - MANTISSA_BITS[got.dtype])
    # plus the spacing of the output dtype's subnormals: a tiny result (one column, fp16) rounds to a
    # multiple of it, an absolute error no relative bound covers
    subnormal = torch.finfo(got.dtype).smallest_normal * ulp
    summing = max(dense.shape[1], 1) * 2.0**-23 * magnitude
    bound = ulp * (expected.abs() + product.abs()) + summing + subnormal
    excess = ((got.double() - expected).abs() - bound).max().item() if got.numel() else 0.0
    assert excess <= 0, f"{what}: error exceeds the bound by {excess:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_m_and_density_matches_the_dense_masked_matmul(op, isa, threads, dtype, shape):
    rows, cols = shape
    for density in DENSITIES:
        dense, weight = sparse_weight(rows, cols, density, dtype, seed=int(density * 10))
        bias = torch.randn(rows).to(dtype)
        for m in [*range(1, 18), 24, 40, 41]:
            x = torch.randn(m, cols).to(dtype)
            got = call(op, x, weight, bias if m % 2 else None)
            assert got.shape == (m, rows) and got.dtype == dtype
            check_close(got, x, dense, bias if m % 2 else None, f"{isa} {dtype} density {density} M {m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 8, 9, 16, 17, 40, 41, 64])
def test_small_integers_give_exact_results(op, isa, dtype, m):
    """Weights +-1 and x in {-1, 0, 1} over 200 columns: every partial sum is an integer below 256, exact
    in fp32 and in both 16-bit types, so every path must match the reference bit for bit."""
    dense, weight = sparse_weight(70, 200, 0.5, dtype, seed=m, integers=True)
    x = torch.randint(-1, 2, (m, 200), generator=torch.Generator().manual_seed(m)).to(dtype)
    expected = (x.double() @ dense.double().T).to(dtype)
    assert torch.equal(call(op, x, weight), expected)


def test_thread_count_does_not_change_the_result(op, isa):
    """Each output is summed by one thread in a fixed order, so 1 and 2 threads agree exactly."""
    dense, weight = sparse_weight(301, 577, 0.4, torch.bfloat16)
    assert_threads_agree(lambda x: call(op, x, weight), 577, (1, 4, 8, 16, 20, 40, 48))


def test_the_library_splits_rows_over_torchs_openmp_threads(op):
    """at::parallel_for is inline code that stays serial unless the extension is compiled with OpenMP (as
    torch is): the built library must call GOMP_parallel and need the libgomp torch has loaded."""
    library = next(cpu_kernel.build_dir().glob("*.so")).read_bytes()
    assert b"GOMP_parallel" in library and b"libgomp.so.1" in library


def test_avx512_and_avx2_agree_within_rounding(op):
    if cpu_kernel.supported_isas() != list(cpu_kernel.ISAS):
        pytest.skip("needs a CPU that runs both kernels")
    dense, weight = sparse_weight(64, 300, 0.5, torch.float32)
    x = torch.randn(3, 300)
    results = {}
    for name in cpu_kernel.ISAS:
        with cpu_kernel.using_isa(name):
            results[name] = call(op, x, weight)
    torch.testing.assert_close(results["avx512"], results["avx2"], rtol=1e-5, atol=1e-5)


def test_leading_dimensions_and_zero_rows_of_x(op, isa):
    dense, weight = sparse_weight(24, 50, 0.5, torch.float32)
    x = torch.randn(2, 3, 50)
    got = call(op, x, weight)
    assert got.shape == (2, 3, 24)
    check_close(got.reshape(6, 24), x.reshape(6, 50), dense, None, "3-D x")
    assert call(op, torch.randn(0, 50), weight).shape == (0, 24)
    strided = torch.randn(4, 100)[:, ::2]  # a non-contiguous view
    check_close(call(op, strided, weight), strided, dense, None, "strided x")


@pytest.mark.parametrize("start,stop", [(0, 20), (20, 45), (13, 14)])
def test_tensor_parallel_slices(op, isa, start, stop):
    """What each rank holds: row ranges (q/k/v, gate/up), re-packed column ranges (o, down), and
    stacked row shards, each against the same slice of the dense masked weight."""
    dense, weight = sparse_weight(45, 90, 0.5, torch.bfloat16)
    x = torch.randn(3, 90).to(torch.bfloat16)
    rows = weight.slice_rows(start, stop)
    check_close(call(op, x, rows), x, dense[start:stop], None, "row slice")
    cols = weight.slice_cols(2 * start, 2 * stop)
    part = x[:, 2 * start:2 * stop]
    check_close(call(op, part, cols), part, dense[:, 2 * start:2 * stop], None, "column slice")
    stacked = BitmapWeight.cat_rows([weight.slice_rows(0, start), rows, weight.slice_rows(stop, 45)])
    check_close(call(op, x, stacked), x, dense, None, "stacked slices")


def test_bad_input_is_refused_with_a_message(op):
    _, weight = sparse_weight(8, 40, 0.5, torch.float32)
    x = torch.randn(2, 40)
    with pytest.raises(RuntimeError, match="values are BFloat16 but x is Float"):
        call(op, x, BitmapWeight(weight.bitmap, weight.values.bfloat16(), weight.row_offsets, 40))
    with pytest.raises(RuntimeError, match="x has 39 features, the weight has 40 columns"):
        call(op, torch.randn(2, 39), weight)
    with pytest.raises(RuntimeError, match="do not account for"):
        call(op, x, BitmapWeight(weight.bitmap, weight.values[:-1], weight.row_offsets, 40))
    with pytest.raises(RuntimeError, match="supports bfloat16, float16 and float32"):
        call(op, x.double(), BitmapWeight(weight.bitmap, weight.values.double(), weight.row_offsets, 40))
    with pytest.raises(RuntimeError, match="unknown kernel 'sse'"):
        torch.ops.leap_sparse_cpu.set_isa("sse")


def corrupt_offset(weight: BitmapWeight, row: int, value: int) -> BitmapWeight:
    offsets = weight.row_offsets.clone()
    offsets[row] = value
    return BitmapWeight(weight.bitmap, weight.values, offsets, weight.n_cols)


def test_a_corrupt_middle_row_offset_is_refused(op, isa):
    """Issue 20: main checked only the first and the last offset; one in the middle shifted a row's values
    (wrong numbers, silently) or pointed outside `values`. Row 4 of 8 starting one value late, or before the
    row above it: each is named, on a direct call of the op as existing callers make it (six arguments)."""
    _, weight = sparse_weight(8, 40, 0.5, torch.float32)
    x = torch.randn(2, 40)
    start = int(weight.row_offsets[4])
    for value in (start + 1, int(weight.row_offsets[3]) - 1):
        expected = rf"row_offsets\[4\] is {value}, but the bitmap puts that row's first value at {start}"
        with pytest.raises(RuntimeError, match=expected):
            call(op, x, corrupt_offset(weight, 4, value))


def test_an_offset_far_outside_values_is_an_error_not_a_crash(op):
    """On main an offset of 2**40 in the middle crashed the process (exit 139)."""
    code = ("import torch; from serving import cpu_kernel; assert cpu_kernel.load()\n"
            "from test_cpu_kernel import corrupt_offset, sparse_weight\n"
            "_, w = sparse_weight(8, 40, 0.5, torch.float32); w = corrupt_offset(w, 4, 2**40)\n"
            "op = torch.ops.leap_sparse_cpu.bitmap_linear\n"
            "try:\n"
            "    op(torch.randn(2, 40), w.bitmap, w.values, w.row_offsets, 40)\n"
            "except RuntimeError as exc:\n"
            "    print(str(exc).splitlines()[0])\n")
    done = run_python(code, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]))
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"row_offsets[4] is {2**40}" in done.stdout


def test_checked_weights_skip_the_per_call_check(op, isa):
    """The layer checks its weight once at load (`BitmapWeight.check`) and says so with `checked=True`; the
    result is the same as a checked call's."""
    _, weight = sparse_weight(37, 173, 0.5, torch.bfloat16)
    weight.check()
    x = torch.randn(3, 173).bfloat16()
    checked = op(x, weight.bitmap, weight.values, weight.row_offsets, 173, None, checked=True)
    assert torch.equal(checked, call(op, x, weight))
    with pytest.raises(ValueError, match=r"row_offsets\[4\]"):
        corrupt_offset(weight, 4, int(weight.row_offsets[4]) + 1).check()


def test_registered_op_with_a_fake_stays_opaque_under_torch_compile(op):
    dense, weight = sparse_weight(12, 30, 0.4, torch.float32)
    args = (torch.randn(4, 30), weight.bitmap, weight.values, weight.row_offsets, 30, torch.randn(12))
    assert_opaque_under_compile(op, args, lambda x: call(op, x, weight), dense)


def test_environment_variable_chooses_the_kernel(op):
    code = "from serving import cpu_kernel; assert cpu_kernel.load(); print(cpu_kernel.current_isa())"
    assert run_python(code, LEAP_SPARSE_CPU_ISA="avx2").stdout.strip() == "avx2"
    assert run_python(code, LEAP_SPARSE_CPU_ISA="auto").stdout.strip() == cpu_kernel.supported_isas()[0]
    bad = run_python(code, LEAP_SPARSE_CPU_ISA="fast")
    assert bad.returncode != 0 and "LEAP_SPARSE_CPU_ISA='fast': use auto, avx512 or avx2" in bad.stderr


def test_build_command_reports_the_kernel(op):
    done = run_python("from serving.cpu_kernel import main; main()")
    assert done.returncode == 0
    assert f"native CPU kernel ready ({cpu_kernel.supported_isas()[0]}" in done.stdout
    assert cpu_kernel.extension_name() in done.stdout
