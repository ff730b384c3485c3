"""The native ops' checks of the offsets they follow into a packed tensor (issue 44, item 3): on a direct
call (`checked=False`, the default) a corrupt row offset of `bitmap_q4_linear` or `bitmap_q4_pack_pairs`, a
corrupt block offset or pass header of `bitmap_q4_i8_linear`, and a corrupt row offset of `bitmap_linear`
each raise a RuntimeError naming the offset, on every instruction set this CPU runs and on both the sparse
kernels' and the tiles' side of M, instead of crashing (far outside the tensor) or multiplying the wrong
weights (one byte off). `checked=True` (a layout checked once, as the vLLM layer's at load) gives the
checked call's result. The offsets far outside the tensor run in a child process, so that a crash fails the
test instead of the test run."""

import pytest
import torch
from kernel_helpers import X86_ONLY, run_python, under_isa
from test_cpu_kernel_q4 import excess

from serving import cpu_kernel
from serving.q4_linear import Q4Weight
from sparse_formats import get_format

pytestmark = X86_ONLY

FMT = get_format("bitmap-q4")
MS = (1, 3, 41, 64)  # the sparse kernels up to 40 rows of x (8 for int8 x), tiles or panels above


@pytest.fixture(scope="module")
def op():
    assert cpu_kernel.load(), cpu_kernel.unavailable_reason()  # an x86-64 machine with g++ must build it
    return torch.ops.leap_sparse_cpu.bitmap_q4_linear


@pytest.fixture
def i8(op, isa):
    """The int8-x op under the `isa` in use (skipped where this CPU or ISA has no int8 kernels)."""
    with under_isa(isa, cpu_kernel.int8_kernel_available, "this CPU lacks AVX-512 VNNI or VBMI2, or GFNI"):
        yield torch.ops.leap_sparse_cpu.bitmap_q4_i8_linear


def encoded(rows: int = 12, cols: int = 192, density: float = 0.5, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return FMT.encode(torch.randn(rows, cols, generator=gen), torch.rand(rows, cols, generator=gen) < density,
                      group_size=64)


def with_offset(t: dict[str, torch.Tensor], row: int, value: int) -> dict[str, torch.Tensor]:
    offsets = t["row_offsets"].clone()
    offsets[row] = value
    return dict(t, row_offsets=offsets)


def q4_call(op, x, t, **kwargs):
    return op(x, t["bitmap"], t["codes"], t["scales"], t["row_offsets"], t["bitmap"].shape[1] * 8, None, None,
              **kwargs)


def test_a_q4_row_offset_one_byte_late_is_refused(op, isa):
    """Row 5 starting one byte late stays inside `codes` and in order: only the bitmap's popcounts see it (on
    main it multiplied rows 4 and 5 with shifted codes, silently)."""
    t = encoded()
    start = int(t["row_offsets"][5])
    bad = with_offset(t, 5, start + 1)
    expected = (rf"bitmap_q4_linear: row_offsets\[5\] is {start + 1}, but the bitmap puts that row's first "
                rf"code byte at {start}")
    for m in MS:
        with pytest.raises(RuntimeError, match=expected):
            q4_call(op, torch.randn(m, 192), bad)


def test_checked_q4_calls_skip_the_check_and_give_the_same_result(op, isa):
    """`checked=True` (the layer, after `Q4Weight.check` at load) gives the checked call's result bit for bit,
    and both are the dense reference within the op's bounds (test_cpu_kernel_q4.excess)."""
    t = encoded(67, 576)
    Q4Weight.from_tensors("bitmap-q4", t).check()
    dense = FMT.decode(t)
    for m in MS:
        x = torch.randn(m, 576).to(torch.bfloat16)
        fast = q4_call(op, x, t, checked=True)
        assert torch.equal(fast, q4_call(op, x, t)), m
        assert excess(fast, x, dense, None) <= 0, m


def test_pack_pairs_checks_the_row_offsets_unless_told_they_were_checked(op):
    t = encoded()
    pack = torch.ops.leap_sparse_cpu.bitmap_q4_pack_pairs
    args = (t["bitmap"], t["codes"], t["scales"], t["row_offsets"], 192)
    start = int(t["row_offsets"][7])
    with pytest.raises(RuntimeError, match=rf"bitmap_q4_pack_pairs: row_offsets\[7\] is {start + 1}, but"):
        pack(*args[:3], with_offset(t, 7, start + 1)["row_offsets"], 192)
    with pytest.raises(RuntimeError, match=r"pack_pairs: the bitmap needs \d+ code bytes, codes holds"):
        pack(t["bitmap"], t["codes"][:-1], *args[2:])
    for made, fast in zip(pack(*args), pack(*args, checked=True), strict=True):
        assert torch.equal(made, fast)


def pair_layout(t: dict[str, torch.Tensor]):
    return Q4Weight.from_tensors("bitmap-q4", t).pairs(checked=True)


def i8_call(op, x, pairs, checked: bool = False, **parts):
    named = {**pairs.tensors(), **parts}
    return op(x, named["masks"], named["codes"], named["block_offsets"], named["scales"], pairs.n_rows,
              pairs.n_cols, None, named.get("zeros"), checked=checked)


def test_a_block_offset_or_pass_header_that_disagrees_with_the_masks_is_refused(i8):
    """A block starting one byte late, or a pass header (the bytes of the pass's rows, which the kernels step
    by) one too large: both inside `codes`, both seen against the masks."""
    pairs = pair_layout(encoded())
    assert pairs.masks.numel(), "a sparse weight takes the layout with masks and headers"
    late = pairs.block_offsets.clone()
    late[2] += 1
    header = pairs.codes.clone()
    header[int(pairs.block_offsets[1]) + 1] += 1  # block 1, pass 0: the bytes of all four rows
    for m in MS:
        x = torch.randn(m, 192)
        late_block = rf"i8_linear: block_offsets\[2\] is {int(late[2])}, but the masks put that block's"
        with pytest.raises(RuntimeError, match=late_block):
            i8_call(i8, x, pairs, block_offsets=late)
        with pytest.raises(RuntimeError, match="the header of block 1, pair 0 in codes does not match"):
            i8_call(i8, x, pairs, codes=header)


def test_checked_i8_calls_give_the_same_result(i8):
    for density in (0.5, 1.0):  # the layout with masks, and the dense one
        pairs = pair_layout(encoded(13, 256, density))
        for m in MS:
            x = torch.randn(m, 256)
            assert torch.equal(i8_call(i8, x, pairs, checked=True), i8_call(i8, x, pairs)), (density, m)


CHILD = r"""
import sys, torch
from serving import cpu_kernel
from serving.q4_linear import Q4Weight
from serving.sparse_linear import BitmapWeight
from sparse_formats import get_format
assert cpu_kernel.load()
ops = torch.ops.leap_sparse_cpu
gen = torch.Generator().manual_seed(0)
t = get_format("bitmap-q4").encode(torch.randn(12, 192, generator=gen),
                                   torch.rand(12, 192, generator=gen) < 0.5)
weight = torch.randn(8, 40, generator=gen)
mask = torch.rand(8, 40, generator=gen) < 0.5
bitmap = BitmapWeight.from_tensors("bitmap", get_format("bitmap").encode(weight, mask))

def report(name, call):
    try:
        call()
        print(name, "no error")
    except RuntimeError as exc:
        print(name, str(exc).splitlines()[0])
    sys.stdout.flush()

def q4(value, m):
    offsets = t["row_offsets"].clone()
    offsets[5] = value
    x = torch.randn(m, 192)
    return lambda: ops.bitmap_q4_linear(x, t["bitmap"], t["codes"], t["scales"], offsets, 192)

def pack(value):
    offsets = t["row_offsets"].clone()
    offsets[5] = value
    return lambda: ops.bitmap_q4_pack_pairs(t["bitmap"], t["codes"], t["scales"], offsets, 192)

def i8(value, m):
    p = Q4Weight.from_tensors("bitmap-q4", t).pairs(checked=True)
    offsets = p.block_offsets.clone()
    offsets[1] = value
    return lambda: ops.bitmap_q4_i8_linear(torch.randn(m, 192), p.masks, p.codes, offsets, p.scales, 12, 192)

def linear(value, m):
    offsets = bitmap.row_offsets.clone()
    offsets[4] = value
    return lambda: ops.bitmap_linear(torch.randn(m, 40), bitmap.bitmap, bitmap.values, offsets, 40)

for isa in cpu_kernel.supported_isas():
    with cpu_kernel.using_isa(isa):
        for m in (1, 41):
            for value in (-10**8, 10**9):
                report(f"{isa} q4 {m} {value}:", q4(value, m))
                report(f"{isa} linear {m} {value}:", linear(value, m))
                if cpu_kernel.int8_kernel_available():
                    report(f"{isa} i8 {m} {value}:", i8(value, m))
        for value in (-10**8, 10**9):
            report(f"{isa} pack {value}:", pack(value))
print("done")
"""


def test_offsets_far_outside_the_tensor_are_errors_not_crashes(op):
    """Issue 44: a row offset of -1e8 crashed bitmap_q4_linear (and 1e9 bitmap_linear); each op on each ISA
    now names the offset in one RuntimeError, and the process lives on."""
    done = run_python(CHILD)
    assert done.returncode == 0 and done.stdout.strip().endswith("done"), done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()[:-1]
    assert lines, done.stdout
    named = {"q4": "bitmap_q4_linear: row_offsets[5] is", "linear": "bitmap_linear: row_offsets[4] is",
             "i8": "bitmap_q4_i8_linear: block_offsets[1] is",
             "pack": "bitmap_q4_pack_pairs: row_offsets[5] is"}
    for line in lines:
        case, message = line.split(":", 1)
        value = case.split()[-1]
        assert f"{named[case.split()[1]]} {value}, but the " in message, line
