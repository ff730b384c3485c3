"""The native int8-x op on bitmap-q4 weights (`leap_sparse_cpu::bitmap_q4_i8_linear`, on the pair layout
that `bitmap_q4_pack_pairs` makes at load) against plain float64 references: x rounded by
`serving.q4_linear.int8_activations` (the definition) times the dequantized dense weight
(`get_format("bitmap-q4").decode`, exact), for every M: up to 8 rows of x the decoding kernel, above the
prefill kernel (a GEMM on int8 x); the prefill's other path (`bitmap_q4_i8_prefill("tiles")`: exact decoded
tiles, x as it is) too. bf16 and fp32 x, 1 and 2 threads, groups of 64 and 128 columns, row counts that are
not a multiple of the layout's blocks of 4, densities 0, 0.5 and 1, the dense layout, the last block's reads
against a guard page; the asymmetric grid (zero points: a kept weight is scale * (code - zero)) on every path
against W built from the dense codes, scales and zero points."""

import dataclasses

import pytest
import torch
from kernel_helpers import (
    X86_ONLY,
    assert_opaque_under_compile,
    assert_threads_agree,
    corrupted_q4,
    run_python,
    under_isa,
)

from serving import cpu_kernel
from serving.q4_linear import INT8_MAX_ROWS, Q4Pairs, Q4Weight, int8_activations
from sparse_formats import get_format

pytestmark = X86_ONLY

FMT = get_format("bitmap-q4")
SIGNIFICANT_BITS = {torch.bfloat16: 8, torch.float32: 24}
# (rows, cols, group): one row, rows not a multiple of 4 (1, 3, 5, 67), one pair per row, the default group,
# 128-column groups, 192 (pairs per group read at run time), rows wider than 2048 columns.
SHAPES = [(1, 64, 64), (3, 128, 64), (5, 192, 64), (67, 576, 64), (13, 2176, 128), (9, 576, 192),
          (6, 4096, 64)]
DENSITIES = [0.0, 0.5, 1.0]
MS = [*range(1, 10), 16, 41, 47, 130]


@pytest.fixture(params=cpu_kernel.ISAS)
def op(request):
    """The op under each instruction set in turn (skipped where this CPU cannot run it): the AVX-512 kernels
    (with VNNI, VBMI2 and GFNI) and the AVX2 ones, which have no prefill kernel (above 8 rows of x their
    decoding kernel, 4 rows at a time)."""
    missing = "this CPU lacks AVX-512 VNNI or VBMI2, or GFNI"
    with under_isa(request.param, cpu_kernel.int8_kernel_available, missing):
        yield torch.ops.leap_sparse_cpu.bitmap_q4_i8_linear


def prefill_kernel() -> bool:
    """Whether more than 8 rows of x in int8 go through a prefill kernel (AVX-512), not the decoding one."""
    return cpu_kernel.current_isa() == "avx512"


@pytest.fixture
def tiles(op):
    """Prefill (above 8 rows of x) through exact decoded tiles and ATen's GEMM, x as it is; restored after."""
    prefill = torch.ops.leap_sparse_cpu.bitmap_q4_i8_prefill
    before = prefill()
    prefill("tiles")
    yield
    prefill(before)


def encoded(rows: int, cols: int, density: float, group: int = 64, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random weight encoded by the format (absmax scales); row 0 kept whole, row 1 emptied (> 2 rows)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen)
    mask = torch.rand(rows, cols, generator=gen) < density
    if rows > 2:
        mask[0], mask[1] = True, False
    return FMT.encode(weight, mask, group_size=group)


def pairs_of(t: dict[str, torch.Tensor]):
    return Q4Weight.from_tensors("bitmap-q4", t).pairs()


def call(op, x, pairs, bias=None):
    return op(x, *pairs.tensors().values(), pairs.n_rows, pairs.n_cols, bias)


def excess(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias, group: int,
           tiles: bool = False, terms: torch.Tensor | None = None) -> float:
    """How far the worst output lies outside its bound (<= 0: all inside). The reference multiplies x as
    the op does (rounded to int8 per group; with `tiles` x as it is above 8 rows) with the exact weight in
    float64. Bounds on the fp32 arithmetic, then the rounding to the output dtype by 2^-bits of the value:
    - up to 8 rows, and on AVX2 every M (the decoding kernel: per 4 (AVX2: 8) columns an exact integer dot,
      scaled and summed in fp32 lanes,
      then across lanes): cols * 2^-23 * sum |x w|;
    - above (the prefill kernel): per group g an exact integer dot d_g times s_g = fp32(0.5 s_w * s_x) (one
      rounding, 2^-24 relative), the G terms summed by fused multiply-adds in group order (G roundings), then
      the bias added (one more): (G + 2) * 2^-24 * (sum |x w| + |b|);
    - with `tiles`: fp32 tiles and GEMM, cols * 2^-23 * sum |x w|; bf16 tiles (bf16 x) 2^-8 * (sum |x w| +
      |b|) more, the bf16 GEMM taking the bias in bf16 as F.linear does.
    `terms`: what the decoding kernel sums in fp32 in place of |w| where that is more (the asymmetric
    grid's)."""
    rows_of_x = x.reshape(-1, x.shape[-1]).shape[0]
    as_is = tiles and rows_of_x > INT8_MAX_ROWS
    multiplied = (x.float() if as_is else int8_activations(x, group)).double()
    b = 0 if bias is None else bias.double()
    expected = multiplied @ dense.double().T + b
    decoding = (rows_of_x <= INT8_MAX_ROWS or not prefill_kernel()) and not as_is
    magnitude = multiplied.abs() @ (terms if decoding and terms is not None else dense.abs()).double().T
    if not decoding and not as_is:
        summing = (dense.shape[1] // group + 2) * 2.0**-24 * (magnitude + abs(b))
    else:
        summing = dense.shape[1] * 2.0**-23 * magnitude
    if x.dtype == torch.bfloat16 and as_is:
        summing = summing + 2.0**-8 * (magnitude + abs(b))
    bound = summing + 2.0 ** -SIGNIFICANT_BITS[got.dtype] * (expected.abs() + summing) + 1e-30
    return ((got.double() - expected).abs() - bound).max().item() if got.numel() else 0.0


def test_the_pair_layout_decodes_to_the_stored_weight_exactly(op, one_thread, tiles):
    """Above 8 rows of x the tiles path multiplies exact fp32 tiles decoded from the pair layout: x = I gives
    W^T bit for bit, so the layout holds every code and scale of every row, blocks padded or not."""
    for rows, cols, group in SHAPES[:5]:
        for density in DENSITIES:
            t = encoded(rows, cols, density, group, seed=rows)
            got = call(op, torch.eye(cols), pairs_of(t))
            assert torch.equal(got.T, FMT.decode(t)), (rows, cols, group, density)


def test_bf16_tiles_are_the_stored_weight_rounded_once(op, one_thread, tiles):
    """With bf16 x above 8 rows the op decodes bf16 tiles directly: x = I gives W^T rounded once to bf16 (as
    ATen rounds the exact fp32 tile), bit for bit, scales from 2^-20 to 2^10, blocks padded or not, the dense
    layout, rows over several tiles."""
    gen = torch.Generator().manual_seed(7)
    for rows, cols, group in [*SHAPES[:5], (16, 192, 64), (300, 4096, 64)]:
        weight = torch.randn(rows, cols, generator=gen) * torch.logspace(-6, 3, rows).unsqueeze(1)
        for density in DENSITIES:
            t = FMT.encode(weight, torch.rand(rows, cols, generator=gen) < density, group_size=group)
            got = call(op, torch.eye(cols).to(torch.bfloat16), pairs_of(t))
            assert torch.equal(got.T, FMT.decode(t).to(torch.bfloat16)), (rows, cols, group, density)


def test_prefill_gives_the_stored_weight_times_127_exactly(op, one_thread):
    """Above 8 rows the prefill kernel rounds x to int8: x = 127 I rounds to itself (scale 1, q = 127;
    other groups 0) and every product 0.5 s_w * 127 * (2 code - 15) is exact in fp32, so the op gives 127 W^T
    bit for bit (fp32 x; bf16 x: rounded once to bf16), through every code and scale of the pair layout and
    its panels of 32 rows, blocks padded or not, the dense layout."""
    gen = torch.Generator().manual_seed(11)
    for rows, cols, group in [*SHAPES[:5], (16, 192, 64), (300, 4096, 64), (40, 640, 320)]:
        weight = torch.randn(rows, cols, generator=gen) * torch.logspace(-6, 3, rows).unsqueeze(1)
        for density in DENSITIES:
            t = FMT.encode(weight, torch.rand(rows, cols, generator=gen) < density, group_size=group)
            pairs, expected = pairs_of(t), FMT.decode(t).T * 127
            x = torch.eye(cols) * 127
            assert torch.equal(call(op, x, pairs), expected), (rows, cols, group, density)
            got = call(op, x.to(torch.bfloat16), pairs)
            assert torch.equal(got, expected.to(torch.bfloat16)), (rows, cols, group, density)


@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}g{s[2]}")
def test_every_m_and_density_matches_the_reference(op, threads, xdtype, shape):
    rows, cols, group = shape
    for density in DENSITIES:
        t = encoded(rows, cols, density, group, seed=int(density * 10) + rows)
        pairs, dense = pairs_of(t), FMT.decode(t)
        bias = torch.randn(rows)
        for m in MS:
            x = torch.randn(m, cols).to(xdtype)
            b = bias if m % 2 else None
            got = call(op, x, pairs, b)
            assert got.shape == (m, rows) and got.dtype == xdtype
            assert excess(got, x, dense, b, group) <= 0, f"{xdtype} density {density} M {m}"


@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_tiles_path_multiplies_x_as_it_is(op, threads, tiles, xdtype):
    for rows, cols, group in SHAPES:
        t = encoded(rows, cols, 0.5, group, seed=rows)
        pairs, dense = pairs_of(t), FMT.decode(t)
        bias = torch.randn(rows)
        for m in (9, 41, 130):
            x = torch.randn(m, cols).to(xdtype)
            b = bias if m % 2 else None
            assert excess(call(op, x, pairs, b), x, dense, b, group, tiles=True) <= 0, (rows, cols, m)


def test_prefill_agrees_with_the_decoding_kernel(op, threads):
    """The same rows of x, 8 at a time (the decoding kernel) and all at once (the prefill kernel): both
    compute sum over groups of fp32(0.5 s_w s_x) * (the exact integer dot), in other orders, so they differ by
    at most both kernels' summing bounds (fp32 x and y)."""
    for rows, cols, group in SHAPES:
        for density in DENSITIES:
            t = encoded(rows, cols, density, group, seed=rows + 1)
            pairs, dense = pairs_of(t), FMT.decode(t)
            bias = torch.randn(rows)
            for m in (9, 41, 100):
                x = torch.randn(m, cols)
                x[m // 2] *= 1e4  # a row with another scale
                whole = call(op, x, pairs, bias).double()
                eights = torch.cat([call(op, x[i : i + 8], pairs, bias) for i in range(0, m, 8)]).double()
                q = int8_activations(x, group).double()
                magnitude = q.abs() @ dense.double().abs().T + bias.double().abs()
                bound = (cols * 2.0**-23 + (cols // group + 2) * 2.0**-24) * magnitude * (1 + 2.0**-22)
                assert ((whole - eights).abs() <= bound).all(), (rows, cols, density, m)


def test_fully_kept_weights_take_the_dense_layout(op, one_thread):
    """Every weight kept (a 4-bit lm_head) and rows a whole number of blocks: the layout has no masks and the
    kernel no expand; the results still match the reference, and the tiles decode to W exactly. One weight
    dropped keeps the masked layout."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(16, 384, generator=gen)
    for group in (64, 128, 192):  # one and two pairs per group unrolled, three read at run time
        t = FMT.encode(weight, torch.ones(16, 384, dtype=torch.bool), group_size=group)
        pairs, dense = pairs_of(t), FMT.decode(t)
        assert pairs.masks.numel() == 0
        assert torch.equal(call(op, torch.eye(384) * 127, pairs).T, dense * 127)
        for m in [*range(1, 10), 41, 100]:
            x = torch.randn(m, 384).to(torch.bfloat16)
            b = torch.randn(16) if m % 2 else None
            assert excess(call(op, x, pairs, b), x, dense, b, group) <= 0, (group, m)
    mask = torch.ones(16, 384, dtype=torch.bool)
    mask[7, 100] = False
    assert pairs_of(FMT.encode(weight, mask)).masks.numel() > 0


def test_a_flipped_code_or_scale_is_seen(op, one_thread):
    """The bound is tight enough to catch one wrong weight (a code's top bit: 8 levels; a doubled scale)."""
    t = encoded(9, 576, 0.5, 64, seed=3)
    dense = FMT.decode(t)
    flipped, rescaled, x_for = corrupted_q4(t, dense)
    for m in (1, 4, 8, 9, 41):
        x = x_for(m)
        assert excess(call(op, x, pairs_of(t)), x, dense, None, 64) <= 0
        assert excess(call(op, x, pairs_of(flipped)), x, dense, None, 64) > 0, m
        assert excess(call(op, x, pairs_of(rescaled)), x, dense, None, 64) > 0, m


def test_small_integers_are_exact_up_to_the_fp32_folding_of_group_sums(op, one_thread):
    """Weights -3, -1, 1, 3 (scale 2, codes 6..9) and x in {-1, 0, 1} (scale 1/127 per group, q = +-127): x
    rounds to itself and every group's integer dot is exact, so the only error left is folding each group's
    sum into fp32 (its product with the fp16 scale times 1/127, and the running sum): at most
    (groups + 2) roundings of 2^-24 of the sum of the groups' absolute values, where a wrong code, mask bit
    or zero point moves an output by at least 1."""
    gen = torch.Generator().manual_seed(1)
    weight = (torch.randint(6, 10, (70, 192), generator=gen).float() - 7.5) * 2
    mask = torch.rand(70, 192, generator=gen) < 0.5
    t = FMT.encode(weight, mask, scales=torch.full((70, 3), 2.0, dtype=torch.float16))
    w = FMT.decode(t).double()
    for m in range(1, 9):
        x = torch.randint(-1, 2, (m, 192), generator=gen).float()
        x[:, ::64] = 1.0  # every group's max |x| is 1
        assert torch.equal(int8_activations(x, 64), x)
        xd = x.double()
        groups = [xd[:, g : g + 64] @ w[:, g : g + 64].T for g in range(0, 192, 64)]
        bound = (len(groups) + 2) * 2.0**-24 * sum(part.abs() for part in groups)
        error = (call(op, x, pairs_of(t)).double() - sum(groups)).abs()
        assert (error <= bound).all(), m


def test_rows_of_x_are_rounded_independently(op, one_thread):
    """Each row of x is quantized on its own scale and each output is the same sequence of operations
    whatever the other rows: a row alone gives bit for bit what it gives among up to 8; above 8 rows (the
    prefill kernel, rows of x 6 at a time and the rest in a shorter call) a row gives the same bits in every
    M and at every position."""
    t = encoded(45, 640, 0.5, 64)
    pairs = pairs_of(t)
    x = torch.randn(8, 640).to(torch.bfloat16)
    x[3] *= 1000  # a row with another scale
    alone = torch.cat([call(op, x[i : i + 1], pairs) for i in range(8)])
    for m in range(2, 9):
        assert torch.equal(call(op, x[:m], pairs), alone[:m]), m
    x = torch.randn(60, 640).to(torch.bfloat16)
    x[7] *= 1000
    full = call(op, x, pairs)
    for m in range(9, 60, 5):
        assert torch.equal(call(op, x[:m], pairs), full[:m]), m
        assert torch.equal(call(op, x[60 - m :], pairs), full[60 - m :]), m


def test_thread_count_does_not_change_the_result(op):
    t = encoded(301, 576, 0.4)
    pairs = pairs_of(t)
    assert_threads_agree(lambda x: call(op, x, pairs), 576, (1, 2, 5, 8, 9, 20, 41, 97))


def test_registered_op_with_a_fake_stays_opaque_under_torch_compile(op):
    t = encoded(16, 128, 0.5)
    pairs = pairs_of(t)
    dense = FMT.decode(t)
    args = (torch.randn(3, 128), pairs.masks, pairs.codes, pairs.block_offsets, pairs.scales, 16, 128)
    rounded = lambda x: int8_activations(x, 64)  # noqa: E731
    assert_opaque_under_compile(op, args, lambda x: call(op, x, pairs), dense, rounded)


def test_bad_input_is_refused_with_a_message(op):
    t = encoded(8, 128, 0.5)
    pairs = pairs_of(t)
    with pytest.raises(RuntimeError, match="x has 127 features, the weight has 128 columns"):
        call(op, torch.randn(2, 127), pairs)
    with pytest.raises(RuntimeError, match="supports bfloat16 and float32 x"):
        call(op, torch.randn(2, 128).half(), pairs)
    with pytest.raises(RuntimeError, match="must be the pair layout"):
        op(torch.randn(2, 128), pairs.masks[:1], pairs.codes, pairs.block_offsets, pairs.scales, 8, 128)
    with pytest.raises(RuntimeError, match="groups of a multiple of 64"):
        op(torch.randn(2, 128), pairs.masks, pairs.codes, pairs.block_offsets, t["scales"], 8, 128)
    pack = torch.ops.leap_sparse_cpu.bitmap_q4_pack_pairs
    with pytest.raises(RuntimeError, match="n_cols must be a positive multiple of 64"):
        pack(t["bitmap"][:, :12], t["codes"], t["scales"], t["row_offsets"], 96)
    with pytest.raises(RuntimeError, match="of a multiple of 64 columns"):
        t32 = encoded(8, 128, 0.5, 32)
        pack(t32["bitmap"], t32["codes"], t32["scales"], t32["row_offsets"], 128)


def test_the_avx2_kernels_take_int8_x(op):
    """`LEAP_SPARSE_CPU_ISA=avx2` (what a CPU without AVX-512 gets) keeps the int8 path, prefill included."""
    code = ("import torch; from serving import cpu_kernel; cpu_kernel.load(); "
            "print(cpu_kernel.int8_kernel_available(), torch.ops.leap_sparse_cpu.bitmap_q4_i8_prefill())")
    done = run_python(code, LEAP_SPARSE_CPU_ISA="avx2")
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "True int8", done.stderr[-2000:]


def test_reads_stay_inside_the_codes(op, one_thread):
    """The last block's 64-byte code loads end inside the padding the layout adds: codes placed just before
    a guard page (an mprotect'ed page) still multiply correctly."""
    code = r"""
import ctypes, mmap, torch
from serving import cpu_kernel
from serving.q4_linear import Q4Weight
from sparse_formats import get_format
cpu_kernel.load()
fmt = get_format("bitmap-q4")
t = fmt.encode(torch.randn(7, 192), torch.rand(7, 192) < 0.9)
p = Q4Weight.from_tensors("bitmap-q4", t).pairs()
n = p.codes.numel()
page = mmap.PAGESIZE
buf = mmap.mmap(-1, 2 * page + page * ((n + page - 1) // page))
base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
guard = base + page * ((n + page - 1) // page)
libc = ctypes.CDLL(None)
assert libc.mprotect(ctypes.c_void_p(guard), page, 0) == 0
start = guard - n
holder = (ctypes.c_uint8 * n).from_address(start)
codes = torch.frombuffer(holder, dtype=torch.uint8, count=n)
codes.copy_(p.codes)
for m in (3, 20):  # the decoding kernel and the prefill kernel's panels
    x = torch.randn(m, 192)
    op = torch.ops.leap_sparse_cpu.bitmap_q4_i8_linear
    got = op(x, p.masks, codes, p.block_offsets, p.scales, 7, 192)
    assert torch.equal(got, op(x, p.masks, p.codes, p.block_offsets, p.scales, 7, 192))
print("ok")
"""
    done = run_python(code)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


# ---- the asymmetric grid: a kept weight is scale * (code - zero), a zero point 0..15 per row and group ----

ASYM_SHAPES = [(1, 64, 64), (3, 128, 64), (5, 192, 64), (67, 576, 64), (13, 2176, 128), (7, 384, 128),
               (9, 576, 192)]
ASYM_MS = [1, 2, 3, 4, 5, 8, 9, 17, 41]


def asymmetric(rows: int, cols: int, group: int, density: float, seed: int = 0):
    """(stored tensors, stored zero points, W, terms) of a random weight on the asymmetric grid: codes, fp16
    scales and zero points 0..15 drawn at random (a fifth of the row-groups with every code at the zero
    point: W 0 there), the tensors packed by the format with the zero points two to a byte as stored (group
    g of a row in byte g / 2, the low nibble for even g), and W = scale * (code - zero) where kept, 0
    elsewhere. Rows 0 and 1 kept whole and emptied (> 2 rows, density < 1). `terms`: per weight, what the
    decoding kernel sums in fp32 (excess): scale * (code, or the zero point where pruned) in the integer dots,
    and scale * zero point in the zero points' term subtracted after them."""
    gen = torch.Generator().manual_seed(seed)
    groups = cols // group
    mask = torch.rand(rows, cols, generator=gen) < density
    if rows > 2 and density < 1:
        mask[0], mask[1] = True, False
    codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (rows, groups), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(rows, groups, generator=gen) * 0.2 + 0.01).half()
    at_zero = (torch.rand(rows, groups, generator=gen) < 0.2).repeat_interleave(group, 1)
    level = zeros.repeat_interleave(group, 1)
    codes = torch.where(at_zero, level, codes)
    weight = scales.float().repeat_interleave(group, 1) * (codes.float() - level.float())
    weight = torch.where(mask, weight, torch.zeros(()))
    padded = torch.cat([zeros, torch.zeros(rows, groups % 2, dtype=torch.uint8)], 1)
    stored = padded[:, 0::2] | (padded[:, 1::2] << 4)
    spread = scales.float().repeat_interleave(group, 1)
    terms = spread * (torch.where(mask, codes.float(), level.float()) + level.float())
    return FMT.pack(codes * mask, scales, mask), stored, weight, terms


def asym_pairs(t: dict[str, torch.Tensor], stored: torch.Tensor, pruned_at_zero: bool = False) -> Q4Pairs:
    rows, cols = t["bitmap"].shape[0], t["bitmap"].shape[1] * 8
    made = torch.ops.leap_sparse_cpu.bitmap_q4_pack_pairs(t["bitmap"], t["codes"], t["scales"],
                                                         t["row_offsets"], cols, stored, pruned_at_zero)
    return Q4Pairs(*made[:4], rows, cols, made[4], pruned_at_zero)


def asym_call(op, x, pairs: Q4Pairs, bias=None):
    return op(x, pairs.masks, pairs.codes, pairs.block_offsets, pairs.scales, pairs.n_rows, pairs.n_cols,
              bias, zeros=pairs.zeros)


def test_pack_pairs_lays_out_the_zero_points(op):
    """One byte per row and group in the scales' order ([blocks, groups, 4], padded rows 0); without zero
    points an empty tensor, which Q4Pairs.tensors() leaves out."""
    t, stored, *_ = asymmetric(7, 384, 64, 0.5)
    pairs = asym_pairs(t, stored)
    zeros = torch.stack([stored & 0xF, stored >> 4], 2).reshape(7, -1)[:, :6]
    expected = torch.cat([zeros, torch.zeros(1, 6, dtype=torch.uint8)]).view(2, 4, 6).transpose(1, 2)
    assert pairs.zeros.dtype == torch.uint8 and torch.equal(pairs.zeros, expected)
    assert list(pairs.tensors()) == ["masks", "codes", "block_offsets", "scales", "zeros"]
    symmetric = pairs_of(encoded(7, 384, 0.5))
    assert symmetric.zeros.shape == (0,) and "zeros" not in symmetric.tensors()


@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", ASYM_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}g{s[2]}")
def test_asymmetric_grid_matches_the_reference(op, threads, xdtype, shape):
    """Every M through the decoding kernel (block_pair_m1, block<1..4>) and the prefill kernel, against
    int8_activations(x) @ W^T with W = scale * (code - zero) on kept weights."""
    rows, cols, group = shape
    for density in DENSITIES:
        t, stored, weight, terms = asymmetric(rows, cols, group, density, seed=rows + int(10 * density))
        pairs = asym_pairs(t, stored)
        bias = torch.randn(rows)
        for m in ASYM_MS:
            x = torch.randn(m, cols).to(xdtype)
            b = bias if m % 2 else None
            got = asym_call(op, x, pairs, b)
            assert got.shape == (m, rows) and got.dtype == xdtype
            assert excess(got, x, weight, b, group, terms=terms) <= 0, f"{xdtype} density {density} M {m}"


def test_asymmetric_prefill_gives_the_weight_times_127_exactly(op, one_thread):
    """x = 127 I (q = 127, x scale 1): every integer dot is 127 (code - zero) and its product with the fp16
    scale exact, so the prefill kernel gives 127 W^T bit for bit: every code, zero point and scale of the
    layout, padded blocks, the dense layout."""
    for rows, cols, group in [*ASYM_SHAPES[:5], (16, 192, 64), (40, 640, 320)]:
        for density in DENSITIES:
            t, stored, weight, _ = asymmetric(rows, cols, group, density, seed=rows)
            got = asym_call(op, torch.eye(cols) * 127, asym_pairs(t, stored))
            assert torch.equal(got, weight.T * 127), (rows, cols, group, density)


def test_asymmetric_tiles_decode_the_weight_exactly(op, one_thread, tiles):
    """The tiles path: x = I gives W^T bit for bit (fp32 tiles) and W^T rounded once to bf16 (bf16 tiles);
    random x within the tiles' bound."""
    for rows, cols, group in ASYM_SHAPES:
        for density in DENSITIES:
            t, stored, weight, _ = asymmetric(rows, cols, group, density, seed=rows + 1)
            pairs = asym_pairs(t, stored)
            assert torch.equal(asym_call(op, torch.eye(cols), pairs).T, weight), (rows, cols, density)
            got = asym_call(op, torch.eye(cols).to(torch.bfloat16), pairs)
            assert torch.equal(got.T, weight.to(torch.bfloat16)), (rows, cols, density)
            for xdtype in (torch.bfloat16, torch.float32):
                x = torch.randn(41, cols).to(xdtype)
                assert excess(asym_call(op, x, pairs), x, weight, None, group, tiles=True) <= 0, (rows, cols)


@pytest.mark.parametrize("group", [64, 128, 192])
def test_asymmetric_dense_layout(op, threads, group):
    """Every weight kept and rows a whole number of blocks: no masks, no expand; every M still matches."""
    t, stored, weight, terms = asymmetric(16, 384, group, 1.0, seed=group)
    pairs = asym_pairs(t, stored)
    assert pairs.masks.numel() == 0
    for m in ASYM_MS:
        x = torch.randn(m, 384).to(torch.bfloat16)
        b = torch.randn(16) if m % 2 else None
        assert excess(asym_call(op, x, pairs, b), x, weight, b, group, terms=terms) <= 0, m


def test_asymmetric_threads_agree_and_the_symmetric_grid_is_untouched(op):
    t, stored, *_ = asymmetric(301, 576, 64, 0.4)
    pairs = asym_pairs(t, stored)
    assert_threads_agree(lambda x: asym_call(op, x, pairs), 576, (1, 2, 5, 8, 9, 41))
    sym = pairs_of(encoded(45, 640, 0.5))
    x = torch.randn(20, 640)
    for m in (1, 3, 8, 20):
        without = call(op, x[:m], sym)
        assert torch.equal(op(x[:m], *sym.tensors().values(), sym.n_rows, sym.n_cols, None,
                              zeros=torch.empty(0, dtype=torch.uint8)), without)


def test_bad_zero_points_are_refused(op):
    t, stored, *_ = asymmetric(8, 384, 64, 0.5)  # 6 groups: 3 bytes a row
    pack = torch.ops.leap_sparse_cpu.bitmap_q4_pack_pairs
    args = (t["bitmap"], t["codes"], t["scales"], t["row_offsets"], 384)
    for bad in (stored[:, :2], stored[:7], torch.zeros(8, 6, dtype=torch.uint8), stored.to(torch.int32),
                stored.reshape(-1)):
        with pytest.raises(RuntimeError, match=r"zeros must be a CPU uint8 tensor \[rows, \(groups \+ 1\)"):
            pack(*args, bad)
    pairs = asym_pairs(t, stored)
    with pytest.raises(RuntimeError, match="zeros must be uint8 \\[blocks, groups, 4\\]"):
        asym_call(op, torch.randn(2, 384), dataclasses.replace(pairs, zeros=pairs.zeros[:, :5]))


def test_pruned_weights_at_their_zero_points_give_the_same_products(op, threads):
    """`pruned_at_zero` lays a sparse weight out dense, each pruned column its group's zero point (the value
    0): no masks, 64 code bytes per pair of rows and pair, and every path gives what the sparse layout
    gives: x = I decodes W exactly through the tiles, random x stays within the reference's bound at every
    M, and on AVX2 the products equal the sparse layout's bit for bit (the same exact integer dots, folded
    the same way)."""
    prefill = torch.ops.leap_sparse_cpu.bitmap_q4_i8_prefill
    for rows, cols, group in ASYM_SHAPES:
        for density in DENSITIES:
            t, stored, weight, terms = asymmetric(rows, cols, group, density, seed=rows + 2)
            sparse, dense = asym_pairs(t, stored), asym_pairs(t, stored, pruned_at_zero=True)
            blocks = (rows + 3) // 4
            assert dense.masks.numel() == 0 and dense.codes.numel() == blocks * 4 * cols // 2 + 64
            assert torch.equal(dense.zeros, sparse.zeros) and torch.equal(dense.scales, sparse.scales)
            before = prefill()
            prefill("tiles")
            try:
                assert torch.equal(asym_call(op, torch.eye(cols), dense).T, weight), (rows, cols, density)
            finally:
                prefill(before)
            for m in ASYM_MS:
                x = torch.randn(m, cols)
                got = asym_call(op, x, dense)
                assert excess(got, x, weight, None, group, terms=terms) <= 0, (rows, cols, density, m)
                if cpu_kernel.current_isa() == "avx2":
                    assert torch.equal(got, asym_call(op, x, sparse)), (rows, cols, density, m)


def test_pruned_at_zero_needs_zero_points_and_is_the_avx2_default(op):
    """The symmetric grid has no level 0, so the op refuses it there; `Q4Weight.pairs()` lays the
    asymmetric grid out that way exactly where the AVX2 kernels run."""
    t = encoded(8, 128, 0.5)
    with pytest.raises(RuntimeError, match="pruned_at_zero needs the asymmetric grid's zeros"):
        torch.ops.leap_sparse_cpu.bitmap_q4_pack_pairs(t["bitmap"], t["codes"], t["scales"], t["row_offsets"],
                                                      128, None, True)
    assert not pairs_of(t).pruned_at_zero
    asym, stored, *_ = asymmetric(8, 128, 64, 0.5)
    weight = Q4Weight.from_tensors("bitmap-q4", {**asym, "zeros": stored})
    assert weight.pairs().pruned_at_zero == (cpu_kernel.current_isa() == "avx2")
