"""y = x W^T (+ b) with W in the `tiled-bitmap` format (layout: `sparse_formats/tiled_bitmap.py`), in Triton.

Why it can beat cuBLAS: decode (M = 1..16 tokens) is memory-bound, and a 50%-sparse fp16 weight in this
format is 1.127 bytes per weight instead of 2. Every program therefore reads each byte of its weight
groups exactly once and does the expansion in registers:

- A program owns one 64-row group of output features, a block of BLOCK_M tokens and a contiguous range
  of 64-column groups (split-K when there are too few row groups to fill the GPU; partial sums go to an
  fp32 buffer [split, M, N] that torch adds up, deterministic and CUDA-graph safe).
- Per group it loads the 64 bitmap words (512 contiguous bytes), splits each word into two 32-bit halves
  and extracts a [64, 64] bit tile. The index of every kept value inside the group's contiguous value
  slice is an exclusive cumsum along the row plus an exclusive cumsum of the row counts down the group,
  so no popcount per weight and no per-row offsets on disk. The values are then a masked gather from
  a slice of at most 8 KiB: each sector comes from DRAM once and is served from L1.
- Compute on the dense [64, 64] tile in registers: for M <= 4 a broadcast multiply and a row
  reduction on the CUDA cores (fp32), for larger M `tl.dot` on the tensor cores with fp32 accumulation
  ("load as sparse, compute as dense"; M is padded to 16 with masked rows).
- Beyond `SPARSE_KERNEL_MAX_M` tokens (prefill), where the GEMM is compute-bound and re-expanding the
  tiles for every block of 128 tokens would cost more than it saves, `tiled_bitmap_linear` expands the
  weight once per call into a dense buffer with the same group expansion (`tiled_bitmap_decode`) and
  hands it to cuBLAS. `bench/kernels.py` measures both paths against dense at every M, which is what
  sets that threshold.

On CPU tensors without `TRITON_INTERPRET=1` (no Triton backend there) the same function decodes with the
format's torch/numpy decoder and calls `torch.nn.functional.linear`, so callers need no device check.
`tensors["shape"]` must stay a CPU tensor (the encoder makes it one): reading it must not sync the GPU.
"""

import os

import torch
import triton
import triton.language as tl

from sparse_formats.tiled_bitmap import GROUP, TiledBitmapFormat

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Up to this many tokens the sparse kernel runs; above it, expand to dense once and use cuBLAS.
SPARSE_KERNEL_MAX_M = 128
_FMA_MAX_M = 4


@triton.jit
def _expand_group(bitmap_ptr, values_ptr, offsets_ptr, group, GROUP: tl.constexpr):
    """The dense [GROUP rows, GROUP cols] tile of one group, in the values' dtype, zeros where pruned."""
    lanes = tl.arange(0, GROUP)
    words = tl.load(bitmap_ptr + group * GROUP + lanes)  # int64, one word per row of the group
    low = words.to(tl.int32)
    high = (words >> 32).to(tl.int32)
    word = tl.where(lanes[None, :] < 32, low[:, None], high[:, None])
    bits = (word >> (lanes[None, :] & 31)) & 1
    before_in_row = tl.cumsum(bits, axis=1) - bits
    per_row = tl.sum(bits, axis=1)
    before_row = tl.cumsum(per_row, axis=0) - per_row
    start = tl.load(offsets_ptr + group)
    return tl.load(values_ptr + start + (before_row[:, None] + before_in_row), mask=bits != 0, other=0.0)


@triton.jit
def _tiled_bitmap_mm_kernel(x_ptr, bitmap_ptr, values_ptr, offsets_ptr, bias_ptr, out_ptr,
                            M, N, K, col_groups, groups_per_split, stride_xm, stride_om, stride_split,
                            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr,
                            DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, GROUP: tl.constexpr):
    row_group = tl.program_id(0)
    m_block = tl.program_id(1)
    split = tl.program_id(2)
    lanes = tl.arange(0, GROUP)
    ms = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = ms < M
    acc = tl.zeros((BLOCK_M, GROUP), dtype=tl.float32)
    first = split * groups_per_split
    last = tl.minimum(first + groups_per_split, col_groups)
    for col_group in range(first, last):
        w = _expand_group(bitmap_ptr, values_ptr, offsets_ptr, row_group * col_groups + col_group, GROUP)
        ks = col_group * GROUP + lanes
        x = tl.load(x_ptr + ms[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & (ks[None, :] < K),
                    other=0.0)
        if USE_DOT and DOT_IN_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        elif USE_DOT:
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    ns = row_group * GROUP + lanes
    n_ok = ns < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ns, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + split * stride_split + ms[:, None] * stride_om + ns[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _tiled_bitmap_decode_kernel(bitmap_ptr, values_ptr, offsets_ptr, out_ptr, N, K, col_groups,
                                GROUP: tl.constexpr):
    row_group = tl.program_id(0)
    col_group = tl.program_id(1)
    w = _expand_group(bitmap_ptr, values_ptr, offsets_ptr, row_group * col_groups + col_group, GROUP)
    lanes = tl.arange(0, GROUP)
    ns = row_group * GROUP + lanes
    ks = col_group * GROUP + lanes
    tl.store(out_ptr + ns[:, None] * K + ks[None, :], w, mask=(ns[:, None] < N) & (ks[None, :] < K))


def _shape(tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    rows, cols = tensors["shape"].tolist()
    return int(rows), int(cols)


def _on_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or _INTERPRET


def tiled_bitmap_decode(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The dense masked weight [N, K], expanded on the device by the kernel's own group expansion."""
    values = tensors["values"]
    if not _on_triton(values):
        return TiledBitmapFormat().decode(tensors)
    rows, cols = _shape(tensors)
    row_groups, col_groups = tensors["bitmap"].shape[:2]
    out = torch.empty(rows, cols, dtype=values.dtype, device=values.device)
    if out.numel():
        _tiled_bitmap_decode_kernel[(row_groups, col_groups)](
            tensors["bitmap"], values, tensors["group_offsets"], out, rows, cols, col_groups, GROUP=GROUP)
    return out


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few splits, so that tests cover split-K


def _block_m(m: int) -> int:
    if m <= _FMA_MAX_M:
        return triton.next_power_of_2(max(m, 1))
    return min(max(16, triton.next_power_of_2(m)), 128)


def tiled_bitmap_linear(x: torch.Tensor, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None = None,
                        *, block_m: int | None = None, split_k: int | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for x [..., K] and W [N, K] in `tiled-bitmap`; y [..., N] in x's dtype.

    `block_m` and `split_k` override the launch heuristics (tests and benchmark sweeps use them)."""
    rows, cols = _shape(tensors)
    values = tensors["values"]
    if x.shape[-1] != cols:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {cols}")
    if x.dtype != values.dtype:
        raise ValueError(f"x is {x.dtype} but the weight values are {values.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, cols)
    m = x2.shape[0]
    if not _on_triton(x2) or (m > SPARSE_KERNEL_MAX_M and block_m is None):
        weight = tiled_bitmap_decode(tensors)
        return torch.nn.functional.linear(x, weight, bias)
    if m == 0 or rows == 0 or values.numel() == 0:  # nothing to multiply (and no empty tensors to launch on)
        y = x2.new_zeros(m, rows)
        return (y if bias is None else y + bias).reshape(*lead, rows)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    row_groups, col_groups = tensors["bitmap"].shape[:2]
    block = block_m or _block_m(m)
    m_blocks = triton.cdiv(m, block)
    if split_k is None:
        wanted = 2 * _sm_count(x2.device)
        split_k = max(1, min(col_groups, triton.cdiv(wanted, max(row_groups * m_blocks, 1))))
    groups_per_split = triton.cdiv(max(col_groups, 1), max(split_k, 1))
    split_k = max(1, triton.cdiv(col_groups, groups_per_split))
    use_dot = block > _FMA_MAX_M
    # numpy has no bf16: the interpreter's dot would multiply the raw bit patterns, so upcast there.
    dot_in_fp32 = _INTERPRET and x.dtype == torch.bfloat16
    dot_precision = "ieee" if x.dtype == torch.float32 else "tf32"
    common = dict(BLOCK_M=block, USE_DOT=use_dot, DOT_PRECISION=dot_precision, DOT_IN_FP32=dot_in_fp32,
                  GROUP=GROUP, num_warps=8 if block >= 4 else 4)
    grid = (row_groups, m_blocks, split_k)
    if split_k == 1:
        y = torch.empty(m, rows, dtype=x.dtype, device=x.device)
        _tiled_bitmap_mm_kernel[grid](
            x2, tensors["bitmap"], values, tensors["group_offsets"], bias if bias is not None else y, y,
            m, rows, cols, col_groups, groups_per_split, x2.stride(0), y.stride(0), 0,
            HAS_BIAS=bias is not None, **common)
        return y.reshape(*lead, rows)
    partial = torch.empty(split_k, m, rows, dtype=torch.float32, device=x.device)
    _tiled_bitmap_mm_kernel[grid](
        x2, tensors["bitmap"], values, tensors["group_offsets"], partial, partial,
        m, rows, cols, col_groups, groups_per_split, x2.stride(0), partial.stride(1), partial.stride(0),
        HAS_BIAS=False, **common)
    y = partial.sum(dim=0)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).reshape(*lead, rows)


__all__ = ["SPARSE_KERNEL_MAX_M", "tiled_bitmap_decode", "tiled_bitmap_linear"]
