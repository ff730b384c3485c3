"""The native op of an 8-bit lm_head (`leap_sparse_cpu::int8_rows_linear`: int8-rows codes as stored, int8 x)
against a float64 reference: x rounded by `serving.int8_linear.int8_rows_activations` (the definition the
portable path uses) times the decoded weight (scale * code, exact). Every row count of x the op takes (each
its own instantiation), odd row counts of W, bf16 and fp32 x, bias, 1 and 2 threads, AVX-512 and AVX2; then
`NativeInt8`, which serving holds, on both sides of the op's 8 rows of x."""

import pytest
import torch
from kernel_helpers import X86_ONLY, assert_opaque_under_compile, assert_threads_agree, under_isa

from serving import cpu_kernel
from serving.int8_linear import (
    INT8_ROWS_MAX_M,
    Int8Weight,
    NativeInt8,
    int8_rows_activations,
    int8_rows_linear,
)

pytestmark = X86_ONLY

SIGNIFICANT_BITS = {torch.bfloat16: 8, torch.float32: 24}
# (rows, cols): one row, odd row counts, one 64-column step, SmolLM2's width, rows wider than 4096 columns.
SHAPES = [(1, 64), (3, 128), (37, 576), (301, 576), (64, 4160)]


@pytest.fixture(params=cpu_kernel.ISAS)
def op(request):
    """The op under each instruction set in turn (skipped where this CPU cannot run it): AVX-512 VNNI
    (u = q + 128 and the row sums) and AVX2 (|w| times q with w's sign)."""
    with under_isa(request.param, cpu_kernel.int8_rows_kernel_available, "this CPU lacks AVX-512 VNNI"):
        yield torch.ops.leap_sparse_cpu.int8_rows_linear


def weight(rows: int, cols: int, seed: int = 0) -> Int8Weight:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8)
    return Int8Weight(codes, (torch.rand(rows, generator=gen) * 0.02 + 1e-3).half())


def call(op, x: torch.Tensor, w: Int8Weight, bias=None) -> torch.Tensor:
    return op(x, w.qweight, w.scales, w.qweight.sum(1, dtype=torch.int32), bias)


def excess(got: torch.Tensor, x: torch.Tensor, w: Int8Weight, bias) -> float:
    """How far the worst output lies outside its bound (<= 0: all inside). The op's integer dot is exact; then
    fp32 roundings: the dot's conversion, s_w * s_x, their product and the bias's addition (4 * 2^-24 of the
    terms), then the output dtype's rounding. The reference's x (q * s_x in fp32, as the portable path
    multiplies it) is rounded once per value: 2^-24 * sum |x w| more."""
    dense = w.qweight.double() * w.scales.double().unsqueeze(1)
    b = 0 if bias is None else bias.double()
    rounded = int8_rows_activations(x).double()
    product = rounded @ dense.T
    summing = 4 * 2.0**-24 * (product.abs() + abs(b)) + 2.0**-24 * (rounded.abs() @ dense.abs().T)
    expected = product + b
    bound = summing + 2.0 ** -SIGNIFICANT_BITS[got.dtype] * (expected.abs() + summing) + 1e-30
    return ((got.double() - expected).abs() - bound).max().item()


@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_m_matches_the_reference(op, threads, xdtype, shape):
    rows, cols = shape
    w = weight(rows, cols, seed=rows)
    bias = torch.randn(rows)
    for m in range(1, INT8_ROWS_MAX_M + 1):
        x = torch.randn(m, cols).to(xdtype)
        b = bias if m % 2 else None
        got = call(op, x, w, b)
        assert got.shape == (m, rows) and got.dtype == xdtype
        assert excess(got, x, w, b) <= 0, f"{xdtype} M {m}"


def test_extreme_codes_and_x_stay_inside_the_int32_sums(op, one_thread):
    """Codes at +-127 and x at +-1 (q = +-127) over 8192 columns: the largest sums the kernel makes (255 *
    127 * cols before each row's sum of codes is taken off, 127^2 * cols after) must not wrap."""
    cols = 8192
    codes = torch.full((9, cols), 127, dtype=torch.int8)
    codes[1::2] = -127
    w = Int8Weight(codes, torch.ones(9, dtype=torch.float16))
    x = torch.ones(2, cols)
    x[1] = -1
    got = call(op, x, w)
    signs = torch.tensor([1.0, -1.0] * 4 + [1.0])
    torch.testing.assert_close(got, torch.stack([signs, -signs]) * 127 * cols, rtol=2.0**-22, atol=0)
    assert excess(got, x, w, None) <= 0


def test_thread_count_does_not_change_the_result(op):
    w = weight(301, 576)
    assert_threads_agree(lambda x: call(op, x, w), 576, range(1, INT8_ROWS_MAX_M + 1))


def test_registered_op_with_a_fake_stays_opaque_under_torch_compile(op):
    # scales a 20th of weight()'s: outputs of order 1, where assert_close's fp32 tolerance covers the bound
    stored = weight(37, 576)
    w = Int8Weight(stored.qweight, stored.scales / 20)
    sums = w.qweight.sum(1, dtype=torch.int32)
    assert_opaque_under_compile(op, (torch.randn(3, 576), w.qweight, w.scales, sums, None),
                                lambda x: op(x, w.qweight, w.scales, sums), w.dense(), int8_rows_activations)


def test_bad_input_is_refused_with_a_message(op):
    w = weight(5, 128)
    sums = w.qweight.sum(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=f"at most {INT8_ROWS_MAX_M} rows of x"):
        op(torch.randn(INT8_ROWS_MAX_M + 1, 128), w.qweight, w.scales, sums)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        narrow = weight(5, 96)
        op(torch.randn(1, 96), narrow.qweight, narrow.scales, narrow.qweight.sum(1, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="row_sums must be int32"):
        op(torch.randn(1, 128), w.qweight, w.scales, sums.long())
    with pytest.raises(RuntimeError, match="x has 64 features"):
        op(torch.randn(1, 64), w.qweight, w.scales, sums)


def test_native_int8_takes_decoding_steps_and_hands_more_rows_on(op, one_thread):
    """Up to 8 rows of x the op itself (bit for bit), above vLLM's oneDNN GEMM where VNNI makes it exact, else
    the op 8 rows at a time: both within the bound, every shape of x."""
    w = weight(37, 576)
    layer = NativeInt8(w, torch.float32)
    for m in (1, INT8_ROWS_MAX_M):
        x = torch.randn(m, 576)
        assert torch.equal(layer(x), call(op, x, w))
    x = torch.randn(2, 10, 576)
    got = layer(x)
    assert got.shape == (2, 10, 37)
    reference = int8_rows_linear(x, w.qweight, w.scales)
    torch.testing.assert_close(got, reference, rtol=1e-3, atol=1e-3 * float(reference.abs().max()))
