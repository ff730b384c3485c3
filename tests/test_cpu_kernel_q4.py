"""The native CPU op on the bitmap-q4 layout (`leap_sparse_cpu::bitmap_q4_linear`) against the dequantized
dense masked matmul computed plainly in float64 (`get_format("bitmap-q4").decode` gives W in fp32, exactly),
on every instruction-set path this CPU runs, x in bf16, fp16 and fp32, 1 and 2 threads, M = 1..17, 24, 40
(the sparse kernels), 41 and 64 (fp32 tiles and ATen's GEMM), groups of 32, 64 and 128 columns, row counts
that are not a multiple of the kernels' blocks, densities 0, 0.5 and 1, tensor-parallel row slices, and
reads that must stay inside the codes tensor (a guard page after it); and the asymmetric grid (`zeros`: a
4-bit zero point per row and group) against a dense weight built in the test from codes, scales and zeros."""

import pytest
import torch
from kernel_helpers import (
    X86_ONLY,
    assert_opaque_under_compile,
    assert_threads_agree,
    corrupted_q4,
    run_python,
)

from serving import cpu_kernel
from sparse_formats import get_format

pytestmark = X86_ONLY

FMT = get_format("bitmap-q4")
XDTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Significant bits of each output dtype: rounding the fp32 result to it costs at most half an ulp, a
# relative 2^-bits (2^-8 for bf16).
SIGNIFICANT_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}
# (rows, cols, group): one row, rows not a multiple of the blocks of 4, 3 or 2 weight rows (1, 3, 5, 67),
# one word per row, a group per word, the default group, 128-column groups, rows wider than 2048 columns.
SHAPES = [(1, 32, 32), (3, 64, 64), (5, 96, 32), (67, 576, 64), (13, 2176, 128), (6, 4096, 64)]
DENSITIES = [0.0, 0.5, 1.0]
MS = [*range(1, 18), 24, 40, 41, 64]


@pytest.fixture(scope="module")
def op():
    assert cpu_kernel.load(), cpu_kernel.unavailable_reason()  # an x86-64 machine with g++ must build it
    return torch.ops.leap_sparse_cpu.bitmap_q4_linear


def encoded(rows: int, cols: int, density: float, group: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random weight encoded by the format itself (absmax scales); row 0 is kept whole and row 1 emptied
    when there are more than two rows, whatever the density."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen)
    mask = torch.rand(rows, cols, generator=gen) < density
    if rows > 2:
        mask[0], mask[1] = True, False
    return FMT.encode(weight, mask, group_size=group)


def call(op, x, t: dict[str, torch.Tensor], bias=None):
    """The op on t's tensors, with t's zero points (the asymmetric grid) when it has them."""
    return op(x, t["bitmap"], t["codes"], t["scales"], t["row_offsets"], t["bitmap"].shape[1] * 8, bias,
              t.get("zeros"))


# Above this many rows of x the op multiplies decoded tiles with ATen's GEMM; with bf16 x the tiles are
# rounded to bf16 first (serving/csrc/bitmap_q4/op.cpp), half an ulp of each weight: 2^-8 relative.
SPARSE_MAX_M = 40


def excess(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias) -> float:
    """How far the worst output lies outside its bound (<= 0: all inside). Per output: the fp32 sums'
    error, at most cols * 2^-23 * sum |x w| (K additions at 2^-24 each, with a factor 2 for the group
    folds and the order), plus 2^-8 * (sum |x w| + |b|) where bf16 tiles round the weights and the bf16 GEMM
    takes the bias in bf16 (as F.linear does), then the rounding to the output dtype, 2^-bits of the value."""
    b = 0 if bias is None else bias.double()
    expected = x.double() @ dense.double().T + b
    magnitude = x.double().abs() @ dense.double().abs().T
    summing = dense.shape[1] * 2.0**-23 * magnitude
    if x.dtype == torch.bfloat16 and x.reshape(-1, x.shape[-1]).shape[0] > SPARSE_MAX_M:
        summing = summing + 2.0**-8 * (magnitude + abs(b))
    # the output dtype's subnormal spacing: a tiny fp16 result rounds to a multiple of it
    subnormal = torch.finfo(got.dtype).smallest_normal * 2.0 ** (1 - SIGNIFICANT_BITS[got.dtype])
    bound = summing + 2.0 ** -SIGNIFICANT_BITS[got.dtype] * (expected.abs() + summing) + subnormal
    return ((got.double() - expected).abs() - bound).max().item() if got.numel() else 0.0


@pytest.mark.parametrize("xdtype", XDTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}g{s[2]}")
def test_every_m_and_density_matches_the_dequantized_dense_matmul(op, isa, threads, xdtype, shape):
    rows, cols, group = shape
    for density in DENSITIES:
        t = encoded(rows, cols, density, group, seed=int(density * 10) + rows)
        dense = FMT.decode(t)
        bias = torch.randn(rows).to(xdtype)
        for m in MS:
            x = torch.randn(m, cols).to(xdtype)
            b = bias if m % 2 else None
            got = call(op, x, t, b)
            assert got.shape == (m, rows) and got.dtype == xdtype
            assert excess(got, x, dense, b) <= 0, f"{isa} {xdtype} density {density} M {m}"


def test_a_flipped_code_or_scale_is_seen(op, isa, one_thread):
    """The bound above is tight enough to catch one wrong weight: flipping one code's top bit (a change of
    8 levels) or doubling one scale puts outputs outside it, for the sparse kernels and the GEMM path."""
    t = encoded(9, 576, 0.5, 64, seed=3)
    dense = FMT.decode(t)
    flipped, rescaled, x_for = corrupted_q4(t, dense)
    for m in (1, 3, 8, 41):
        x = x_for(m)
        assert excess(call(op, x, t), x, dense, None) <= 0
        assert excess(call(op, x, flipped), x, dense, None) > 0, m
        assert excess(call(op, x, flipped), x, FMT.decode(flipped), None) <= 0
        assert excess(call(op, x, rescaled), x, dense, None) > 0, m


@pytest.mark.parametrize("xdtype", XDTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 16, 17, 40, 41, 64])
def test_small_integers_give_exact_results(op, isa, one_thread, xdtype, m):
    """Scale 2 and codes 6..9 give weights -3, -1, 1, 3; x in {-1, 0, 1} over 160 columns (half kept): every
    partial sum is an integer below 256, exact in fp32 and in both 16-bit types, so every path must match
    the reference bit for bit."""
    gen = torch.Generator().manual_seed(m)
    weight = (torch.randint(6, 10, (70, 160), generator=gen).float() - 7.5) * 2
    mask = torch.rand(70, 160, generator=gen) < 0.5
    t = FMT.encode(weight, mask, scales=torch.full((70, 5), 2.0, dtype=torch.float16))
    x = torch.randint(-1, 2, (m, 160), generator=gen).to(xdtype)
    expected = (x.double() @ FMT.decode(t).double().T).to(xdtype)
    assert torch.equal(call(op, x, t), expected)


@pytest.mark.parametrize("xdtype", XDTYPES, ids=str)
def test_the_gemm_tiles_are_the_stored_weight_rounded_once(op, isa, one_thread, xdtype):
    """Above SPARSE_MAX_M rows x = I gives the tiles themselves: for fp16 and fp32 x the exact weight, for
    bf16 x the exact weight rounded once to bf16 (the AVX-512 kernels write bf16 tiles directly, AVX2
    converts its fp32 ones), bit for bit; scales from 2^-20 to 2^10, densities 0, 0.5 and 1, rows over
    several tiles."""
    gen = torch.Generator().manual_seed(11)
    for rows, cols, group in [(67, 576, 64), (13, 2176, 128), (300, 4096, 64)]:
        weight = torch.randn(rows, cols, generator=gen) * torch.logspace(-6, 3, rows).unsqueeze(1)
        for density in DENSITIES:
            t = FMT.encode(weight, torch.rand(rows, cols, generator=gen) < density, group_size=group)
            got = call(op, torch.eye(cols).to(xdtype), t)
            assert torch.equal(got.T, FMT.decode(t).to(xdtype)), (isa, rows, cols, density)


def test_thread_count_does_not_change_the_result(op, isa):
    """Each output is summed by one thread in a fixed order, so 1 and 2 threads agree exactly."""
    t = encoded(301, 576, 0.4)
    assert_threads_agree(lambda x: call(op, x, t), 576, (1, 2, 3, 4, 8, 16, 20, 40, 48))


@pytest.mark.parametrize("group", [32, 64, 128])
def test_a_row_of_x_gets_the_same_result_whatever_the_other_rows(op, isa, one_thread, group):
    """Up to 40 rows of x each output is the same sequence of operations whatever M (bf16 x at M <= 4 runs
    a loop of its own on AVX-512, larger M the general blocks and chunks): every row of x alone gives
    bit for bit what it gives among others."""
    t = encoded(45, 640, 0.5, group)
    x = torch.randn(40, 640).to(torch.bfloat16)
    alone = torch.cat([call(op, x[i : i + 1], t) for i in range(40)])
    for m in (2, 3, 4, 5, 8, 9, 17, 40):
        assert torch.equal(call(op, x[:m], t), alone[:m]), m


def test_avx512_and_avx2_agree_within_rounding(op, one_thread):
    if cpu_kernel.supported_isas() != list(cpu_kernel.ISAS):
        pytest.skip("needs a CPU that runs both kernels")
    t = encoded(64, 320, 0.5, 32)
    for xdtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 320).to(xdtype)
        results = {}
        for name in cpu_kernel.ISAS:
            with cpu_kernel.using_isa(name):
                results[name] = call(op, x, t).float()
        tol = 1e-5 if xdtype == torch.float32 else 2.0**-7
        torch.testing.assert_close(results["avx512"], results["avx2"], rtol=tol, atol=tol)


@pytest.mark.parametrize("start,stop", [(0, 20), (20, 45), (13, 14), (44, 45)])
def test_tensor_parallel_row_slices(op, isa, one_thread, start, stop):
    """What a rank holds of a column-parallel layer: rows start..stop, their codes re-based by the first
    offset, against the same rows of the dense weight."""
    t = encoded(45, 192, 0.5)
    dense = FMT.decode(t)
    offsets = t["row_offsets"].long()
    first = int(offsets[start])
    last = int(offsets[stop]) if stop < 45 else t["codes"].numel()
    part = {"bitmap": t["bitmap"][start:stop], "codes": t["codes"][first:last],
            "scales": t["scales"][start:stop], "row_offsets": (t["row_offsets"][start:stop] - first)}
    for m in (1, 5, 41):
        x = torch.randn(m, 192).to(torch.bfloat16)
        assert excess(call(op, x, part), x, dense[start:stop], None) <= 0


def test_leading_dimensions_strides_and_zero_rows_of_x(op, isa, one_thread):
    t = encoded(24, 64, 0.5)
    dense = FMT.decode(t)
    x = torch.randn(2, 3, 64)
    got = call(op, x, t)
    assert got.shape == (2, 3, 24)
    assert excess(got.reshape(6, 24), x.reshape(6, 64), dense, None) <= 0
    assert call(op, torch.randn(0, 64), t).shape == (0, 24)
    strided = torch.randn(4, 128).to(torch.bfloat16)[:, ::2]  # a non-contiguous view
    assert excess(call(op, strided, t), strided, dense, None) <= 0
    bias = torch.randn(24, dtype=torch.float64)  # any float dtype, added in fp32
    assert excess(call(op, x[0], t, bias), x[0], dense, bias) <= 0


def test_validate_checks_every_row(op):
    t = encoded(10, 128, 0.5)
    args = (t["bitmap"], t["codes"], t["scales"], t["row_offsets"], 128)
    torch.ops.leap_sparse_cpu.bitmap_q4_validate(*args)
    wrong = t["row_offsets"].clone()
    wrong[5] += 1
    validate = torch.ops.leap_sparse_cpu.bitmap_q4_validate
    with pytest.raises(RuntimeError, match=r"row_offsets\[5\] is \d+, but the bitmap puts that row's first"):
        validate(t["bitmap"], t["codes"], t["scales"], wrong, 128)
    with pytest.raises(RuntimeError, match="codes holds"):
        validate(t["bitmap"], t["codes"][:-1], t["scales"], t["row_offsets"], 128)


def test_bad_input_is_refused_with_a_message(op):
    t = encoded(8, 128, 0.5)
    x = torch.randn(2, 128)

    def with_(**parts):
        return call(op, parts.pop("x", x), {**t, **parts})

    with pytest.raises(RuntimeError, match="x has 127 features, the weight has 128 columns"):
        with_(x=torch.randn(2, 127))
    with pytest.raises(RuntimeError, match="supports bfloat16, float16 and float32 x"):
        with_(x=x.double())
    with pytest.raises(RuntimeError, match="scales must be float16"):
        with_(scales=t["scales"].float())
    with pytest.raises(RuntimeError, match="whole 32-column words"):
        with_(scales=torch.ones(8, 8, dtype=torch.float16))  # groups of 16 columns
    with pytest.raises(RuntimeError, match="row_offsets must be int32"):
        with_(row_offsets=t["row_offsets"].long())
    with pytest.raises(RuntimeError, match="codes must be 1-D uint8"):
        with_(codes=t["codes"].view(1, -1))
    with pytest.raises(RuntimeError, match="do not account for"):
        with_(codes=t["codes"][:-1])
    with pytest.raises(RuntimeError, match="do not account for"):
        with_(row_offsets=t["row_offsets"] + 1)
    with pytest.raises(RuntimeError, match="n_cols must be a positive multiple of 32"):
        bitmap40 = torch.zeros(8, 5, dtype=torch.uint8)
        op(torch.randn(2, 40), bitmap40, t["codes"], t["scales"], t["row_offsets"], 40)
    with pytest.raises(RuntimeError, match="bias must have 8 entries"):
        call(op, x, t, torch.randn(7))


def test_registered_op_with_a_fake_stays_opaque_under_torch_compile(op):
    t = encoded(12, 64, 0.4)
    dense = FMT.decode(t)
    args = (torch.randn(4, 64), t["bitmap"], t["codes"], t["scales"], t["row_offsets"], 64, torch.randn(12))
    assert_opaque_under_compile(op, args, lambda x: call(op, x, t), dense)


# Run in a child process: a read past the end of the codes is a segmentation fault there, not here.
GUARD_PAGE = """
import ctypes, mmap, sys, torch
from serving import cpu_kernel
from sparse_formats import get_format
assert cpu_kernel.load()
torch.ops.leap_sparse_cpu.set_isa(sys.argv[1])
libc = ctypes.CDLL(None)
fmt = get_format("bitmap-q4")
buffers = []


def guarded(tensor):  # a copy of the uint8 tensor that ends right before an inaccessible page
    n = tensor.numel()
    page = mmap.PAGESIZE
    size = (n // page + 2) * page
    buf = mmap.mmap(-1, size)
    buffers.append(buf)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert libc.mprotect(ctypes.c_void_p(addr + size - page), page, 0) == 0  # PROT_NONE after the data
    copy = torch.frombuffer(buf, dtype=torch.uint8)[size - page - n:size - page].view(tensor.shape)
    copy.copy_(tensor)
    return copy


for rows, density, group in ((3, 1.0, 32), (40, 0.03, 32), (1, 0.02, 32), (17, 0.5, 32), (5, 0.5, 128)):
    t = fmt.encode(torch.randn(rows, 256), torch.rand(rows, 256) < density, group_size=group)
    codes = guarded(t["codes"])
    dense = fmt.decode(t)
    # the asymmetric grid: zero points 8 (as 7.5, but whole), in a guarded tensor too ((groups + 1) / 2 bytes)
    groups = 256 // group
    zeros = guarded(torch.full((rows, (groups + 1) // 2), 0x88, dtype=torch.uint8))
    codes8, scales, mask = fmt.unpack(t)
    shifted = torch.where(mask, scales.float().repeat_interleave(group, 1) * (codes8.float() - 8), 0.0)
    for m in (1, 3, 8, 9, 41):
        x = torch.randn(m, 256).to(torch.bfloat16)
        for z, w in ((None, dense), (zeros, shifted)):
            y = torch.ops.leap_sparse_cpu.bitmap_q4_linear(x, t["bitmap"], codes, t["scales"],
                                                           t["row_offsets"], 256, None, z)
            ref = x.float() @ w.T
            assert torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2 * (1 + float(ref.abs().max())))
print("inside")
"""


def test_reads_stay_inside_the_codes_tensor(op, isa):
    """The codes (and the zero points) end right before an inaccessible page: a load past their end kills the
    child process."""
    done = run_python(GUARD_PAGE, isa)
    assert done.returncode == 0 and done.stdout.strip() == "inside", done.stderr[-2000:]


# ---- the asymmetric grid: W = scale * (code - zero) on kept entries, a 4-bit zero per row and group ----


def pack_zeros(zeros: torch.Tensor) -> torch.Tensor:
    """zeros [rows, groups] (0..15) as the op takes them: uint8 [rows, (groups + 1) / 2], group g in byte
    g / 2, the low nibble for even g (an odd count's last high nibble 0)."""
    if zeros.shape[1] % 2:
        zeros = torch.cat([zeros, torch.zeros(zeros.shape[0], 1, dtype=zeros.dtype)], dim=1)
    return (zeros[:, 0::2] | zeros[:, 1::2] << 4).to(torch.uint8).contiguous()


def asymmetric(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, mask: torch.Tensor):
    """(the stored tensors with packed zeros, the dense fp32 weight: scale * (code - zero) where kept, else
    0)."""
    group = mask.shape[1] // scales.shape[1]
    t = FMT.pack(codes, scales, mask)
    t["zeros"] = pack_zeros(zeros)
    level = codes.float() - zeros.float().repeat_interleave(group, dim=1)
    dense = torch.where(mask, scales.float().repeat_interleave(group, dim=1) * level, torch.zeros(()))
    return t, dense


def random_asymmetric(rows: int, cols: int, group: int, density: float = 0.5, seed: int = 0):
    """Random codes, positive scales from 2^-10 to 1 and nonuniform zero points 0..15 (every value where there
    are enough groups); row 0 kept whole, row 1 emptied (more than two rows); group 0 of the last row with all
    its kept weights at the zero level (a group of zeros)."""
    gen = torch.Generator().manual_seed(seed)
    groups = cols // group
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    mask = torch.rand(rows, cols, generator=gen) < density
    if rows > 2:
        mask[0], mask[1] = True, False
    scales = (2.0 ** -(10 * torch.rand(rows, groups, generator=gen))).to(torch.float16)
    zeros = (torch.randperm(16, generator=gen).repeat(rows * groups // 16 + 1)[: rows * groups]
             .view(rows, groups).to(torch.uint8))
    codes[-1, :group] = zeros[-1, 0]
    return asymmetric(codes, scales, zeros, mask)


# (rows, cols, group): an odd number of groups (3, 3, 17, 9), an even one (8, 64), rows not a multiple of the
# kernels' blocks, more than 16 groups a row (the AVX-512 M <= 4 kernel reads zero points 16 groups a step).
ASYM_SHAPES = [(5, 96, 32), (7, 192, 64), (9, 256, 32), (67, 576, 64), (13, 2176, 128), (6, 4096, 64)]
ASYM_MS = [1, 2, 3, 4, 5, 8, 9, 17, 40, 41, 64]


@pytest.mark.parametrize("xdtype", XDTYPES, ids=str)
@pytest.mark.parametrize("shape", ASYM_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}g{s[2]}")
def test_asymmetric_grid_matches_its_dense_matmul(op, isa, threads, xdtype, shape):
    rows, cols, group = shape
    t, dense = random_asymmetric(rows, cols, group, seed=rows)
    assert not dense[-1, :group].any()
    bias = torch.randn(rows).to(xdtype)
    for m in ASYM_MS:
        x = torch.randn(m, cols).to(xdtype)
        b = bias if m % 2 else None
        got = call(op, x, t, b)
        assert got.shape == (m, rows) and got.dtype == xdtype
        assert excess(got, x, dense, b) <= 0, f"{isa} {xdtype} M {m}"


@pytest.mark.parametrize("xdtype", XDTYPES, ids=str)
def test_asymmetric_small_integers_give_exact_results(op, isa, one_thread, xdtype):
    """Scale 1 and codes within 1 of their group's zero point (0..15, clamped): weights -1, 0, 1, x in
    {-1, 0, 1} over 160 columns (5 groups of 32): every partial sum is an integer below 256, so every path (M
    from the sparse kernels to the bf16 and fp32 tiles) must match the reference bit for bit."""
    gen = torch.Generator().manual_seed(5)
    zeros = torch.randint(0, 16, (70, 5), generator=gen, dtype=torch.uint8)
    step = torch.randint(-1, 2, (70, 160), generator=gen)
    codes = (zeros.repeat_interleave(32, dim=1) + step).clamp(0, 15).to(torch.uint8)
    mask = torch.rand(70, 160, generator=gen) < 0.5
    t, dense = asymmetric(codes, torch.ones(70, 5, dtype=torch.float16), zeros, mask)
    for m in (1, 2, 3, 5, 8, 9, 17, 40, 41, 64):
        x = torch.randint(-1, 2, (m, 160), generator=gen).to(xdtype)
        assert torch.equal(call(op, x, t), (x.double() @ dense.double().T).to(xdtype)), m


@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32], ids=str)
def test_asymmetric_gemm_tiles_are_the_weight_rounded_once(op, isa, one_thread, xdtype):
    """x = I above SPARSE_MAX_M rows: the tiles themselves (exact in fp32, rounded once to bf16 for bf16 x),
    over several tiles (300 rows of 4096 columns)."""
    for rows, cols, group in [(67, 576, 64), (300, 4096, 64)]:
        t, dense = random_asymmetric(rows, cols, group, seed=cols)
        assert torch.equal(call(op, torch.eye(cols).to(xdtype), t).T, dense.to(xdtype)), (isa, rows, cols)


def test_asymmetric_results_do_not_depend_on_threads_or_the_other_rows_of_x(op, isa):
    t, _ = random_asymmetric(301, 576, 64, density=0.4)
    assert_threads_agree(lambda x: call(op, x, t), 576, (1, 2, 3, 4, 8, 16, 20, 40, 48))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(40, 576).to(torch.bfloat16)
        alone = torch.cat([call(op, x[i : i + 1], t) for i in range(40)])
        for m in (2, 4, 5, 9, 40):
            assert torch.equal(call(op, x[:m], t), alone[:m]), m
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("start,stop", [(0, 20), (20, 45), (13, 14), (44, 45)])
def test_asymmetric_tensor_parallel_row_slices(op, isa, one_thread, start, stop):
    """A rank's rows start..stop: codes re-based by the first offset, scales and zero points sliced alike."""
    t, dense = random_asymmetric(45, 192, 64)
    first = int(t["row_offsets"][start])
    last = int(t["row_offsets"][stop]) if stop < 45 else t["codes"].numel()
    part = {"bitmap": t["bitmap"][start:stop], "codes": t["codes"][first:last],
            "scales": t["scales"][start:stop], "row_offsets": t["row_offsets"][start:stop] - first,
            "zeros": t["zeros"][start:stop]}
    for m in (1, 5, 9, 41):
        x = torch.randn(m, 192).to(torch.bfloat16)
        bias = torch.randn(stop - start) if m % 2 else None
        assert excess(call(op, x, part, bias), x, dense[start:stop], bias) <= 0


def test_bad_zeros_are_refused_with_a_message(op):
    t, _ = random_asymmetric(8, 192, 64)  # 3 groups: 2 bytes a row
    validate = torch.ops.leap_sparse_cpu.bitmap_q4_validate
    args = (t["bitmap"], t["codes"], t["scales"], t["row_offsets"], 192)
    validate(*args, t["zeros"])
    shape = (r"zeros must be uint8 \[8, 2\] \(two 4-bit zero points a byte for the 3 groups of each row\), "
             "got ")
    for zeros, got in [(torch.zeros(8, 3, dtype=torch.uint8), r"Byte \[8, 3\]"),
                       (torch.zeros(7, 2, dtype=torch.uint8), r"Byte \[7, 2\]"),
                       (torch.zeros(16, dtype=torch.uint8), r"Byte \[16\]"),
                       (t["zeros"].to(torch.int32), r"Int \[8, 2\]")]:
        with pytest.raises(RuntimeError, match="bitmap_q4_linear: " + shape + got):
            call(op, torch.randn(2, 192), {**t, "zeros": zeros})
        with pytest.raises(RuntimeError, match="bitmap_q4_validate: " + shape + got):
            validate(*args, zeros)


def test_asymmetric_op_stays_opaque_under_torch_compile(op):
    t, dense = random_asymmetric(12, 64, 32)
    args = (torch.randn(4, 64), t["bitmap"], t["codes"], t["scales"], t["row_offsets"], 64, torch.randn(12),
            t["zeros"])
    assert_opaque_under_compile(op, args, lambda x: call(op, x, t), dense)
