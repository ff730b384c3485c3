"""y = x W^T (+ b) with W in the `tiled-bitmap` format (layout: `sparse_formats/tiled_bitmap.py`), in Triton.

Why it can beat cuBLAS: decode (M = 1..16 tokens) is memory-bound, and a 50%-sparse fp16 weight in this
format is 1.127 bytes per weight instead of 2. Every program reads each byte of its weight groups once
and expands them in registers:

- A program owns one 64-row group of output features, a block of tokens and a contiguous range of
  64-column groups (split-K: enough programs for several per SM, so that memory latency hides behind
  other programs). The last split of an output tile to finish adds the fp32 partial sums of all splits
  (a ticket counter per tile, reset by that program), so a call is one kernel launch, CUDA-graph safe.
- Expansion: the group's 64 bitmap words (512 contiguous bytes) become [64 rows, 8 bytes]. A value's
  index inside the group's contiguous value slice is (values in earlier rows) + (in earlier bytes of
  its row) + (in earlier bits of its byte). The first two are scans over 64 and 8 entries per group;
  the last is a running sum over the eight bit planes, unrolled: each plane's pointers advance by its
  bits. Each plane is then a masked gather from the group's slice of at most 8 KiB, whose sectors come
  from DRAM once and then from L1.
- M = 1: the eight planes multiply strided slices of x on the CUDA cores, fp32, accumulated per byte;
  one reduction after the loop. M > 1: `tl.join` puts the planes side by side (column 8b + j) into a
  dense [64, 64] tile for `tl.dot` on the tensor cores, fp32 accumulation, M padded to 16.
- Beyond `SPARSE_KERNEL_MAX_M` tokens (prefill, compute-bound) the weight is expanded once per call
  into a dense buffer by the same group expansion (`tiled_bitmap_decode`) and multiplied by cuBLAS;
  `bench/kernels.py` measures both paths against dense at every M, which is what sets that threshold.

On CPU tensors without `TRITON_INTERPRET=1` (no Triton backend there) the same function decodes with the
format's decoder and calls `torch.nn.functional.linear`, so callers need no device check.
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


@triton.jit
def _load_group(bitmap_ptr, offsets_ptr, values_ptr, group, rows_to_load, GROUP: tl.constexpr):
    """A group's 64 bitmap words (one per row) and a pointer to its first value; loops fetch the next
    group's while they expand the current one, so that this DRAM round trip overlaps the gathers.
    `rows_to_load` is GROUP, or 0 past the last group (group_offsets has one entry more than groups)."""
    rows = tl.arange(0, GROUP)
    words = tl.load(bitmap_ptr + group * GROUP + rows, mask=rows < rows_to_load, other=0)
    return words, values_ptr + tl.load(offsets_ptr + group)


@triton.jit
def _group_bytes(words, group_values, GROUP: tl.constexpr):
    """A group's bitmap as [rows, 8] bytes (byte b = columns 8b .. 8b+7), and for each byte a pointer to
    its first kept value (the group's first value + kept values in earlier rows + in earlier bytes)."""
    byte_index = tl.arange(0, GROUP // 8)
    low = words.to(tl.int32)
    high = (words >> 32).to(tl.int32)
    half = tl.where(byte_index[None, :] < 4, low[:, None], high[:, None])
    byte = (half >> ((byte_index[None, :] & 3) * 8)) & 0xFF
    count = byte - ((byte >> 1) & 0x55)  # popcount of a byte, SWAR (no popc in the interpreter)
    count = (count & 0x33) + ((count >> 2) & 0x33)
    count = (count + (count >> 4)) & 0x0F
    before_byte = tl.cumsum(count, axis=1) - count
    per_row = tl.sum(count, axis=1)
    before_row = tl.cumsum(per_row, axis=0) - per_row
    return byte, group_values + (before_row[:, None] + before_byte)


@triton.jit
def _plane(value_ptrs, byte, J: tl.constexpr):
    """Bit J of every byte (column 8b + J): its value (0 where pruned), and the pointers advanced past it
    (one 32x32+64-bit multiply-add per weight, no separate index arithmetic)."""
    bit = (byte >> J) & 1
    return tl.load(value_ptrs, mask=bit != 0, other=0.0), value_ptrs + bit


@triton.jit
def _expand_group(words, group_values, GROUP: tl.constexpr):
    """The dense [GROUP rows, GROUP cols] tile of one group in the values' dtype, zeros where pruned."""
    byte, value_ptrs = _group_bytes(words, group_values, GROUP)
    w0, value_ptrs = _plane(value_ptrs, byte, 0)
    w1, value_ptrs = _plane(value_ptrs, byte, 1)
    w2, value_ptrs = _plane(value_ptrs, byte, 2)
    w3, value_ptrs = _plane(value_ptrs, byte, 3)
    w4, value_ptrs = _plane(value_ptrs, byte, 4)
    w5, value_ptrs = _plane(value_ptrs, byte, 5)
    w6, value_ptrs = _plane(value_ptrs, byte, 6)
    w7, value_ptrs = _plane(value_ptrs, byte, 7)
    # w{j}[r, b] is column 8b + j; join so that the three new axes spell j in binary, high bit first.
    tile = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
    return tl.reshape(tile, (GROUP, GROUP))


@triton.jit
def _finish(acc, ms, ns, M, N, bias_ptr, out_ptr, stride_om, partial_ptr, ticket_ptr, split, n_splits,
            HAS_BIAS: tl.constexpr):
    """Write acc [BLOCK_M, GROUP] (fp32). With split-K, each program stores its partial sums, and the
    last of the splits of this output tile to take a ticket adds them up, so no second kernel runs;
    it also resets the ticket counter to 0 for the next call."""
    mask = (ms[:, None] < M) & (ns[None, :] < N)
    out = out_ptr + ms[:, None] * stride_om + ns[None, :]
    if n_splits > 1:
        tile = ms[:, None] * N + ns[None, :]
        tl.store(partial_ptr + split * M * N + tile, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial sums are written before the ticket is taken
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == n_splits - 1:
            acc = tl.load(partial_ptr + tile, mask=mask, other=0.0, cache_modifier=".cg")
            for other in range(1, n_splits):
                acc += tl.load(partial_ptr + other * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                acc += tl.load(bias_ptr + ns, mask=ns < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(ticket_ptr, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + ns, mask=ns < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tiled_bitmap_gemv_kernel(x_ptr, bitmap_ptr, values_ptr, offsets_ptr, bias_ptr, out_ptr, partial_ptr,
                              ticket_ptr, N, K, col_groups, groups_per_split, n_splits,
                              HAS_BIAS: tl.constexpr, GROUP: tl.constexpr):
    """One token: the eight bit planes of each group multiply strided slices of x directly (CUDA cores,
    fp32), summed per byte across groups; the sum over bytes happens once, after the loop."""
    row_group = tl.program_id(0)
    split = tl.program_id(1)
    byte_index = tl.arange(0, GROUP // 8)
    acc = tl.zeros((GROUP, GROUP // 8), dtype=tl.float32)
    first = split * groups_per_split
    end = tl.minimum(first + groups_per_split, col_groups)
    group = row_group * col_groups + first
    words, group_values = _load_group(bitmap_ptr, offsets_ptr, values_ptr, group, GROUP, GROUP)
    for col_group in range(first, end):
        next_rows = tl.where(col_group + 1 < end, GROUP, 0)
        next_words, next_values = _load_group(bitmap_ptr, offsets_ptr, values_ptr, group + 1, next_rows,
                                              GROUP)
        byte, value_ptrs = _group_bytes(words, group_values, GROUP)
        ks = col_group * GROUP + byte_index * 8
        for j in tl.static_range(8):
            w, value_ptrs = _plane(value_ptrs, byte, j)
            x = tl.load(x_ptr + ks + j, mask=ks + j < K, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        words, group_values, group = next_words, next_values, group + 1
    ns = row_group * GROUP + tl.arange(0, GROUP)
    _finish(tl.sum(acc, axis=1)[None, :], tl.arange(0, 1), ns, 1, N, bias_ptr, out_ptr, 0, partial_ptr,
            ticket_ptr + row_group, split, n_splits, HAS_BIAS)


@triton.jit
def _tiled_bitmap_mm_kernel(x_ptr, bitmap_ptr, values_ptr, offsets_ptr, bias_ptr, out_ptr, partial_ptr,
                            ticket_ptr, M, N, K, col_groups, groups_per_split, n_splits, stride_xm, stride_om,
                            HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
                            DOT_IN_FP32: tl.constexpr, GROUP: tl.constexpr):
    """Several tokens: expand each group to a dense tile in registers and multiply on the tensor cores."""
    row_group = tl.program_id(0)
    m_block = tl.program_id(1)
    split = tl.program_id(2)
    lanes = tl.arange(0, GROUP)
    ms = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, GROUP), dtype=tl.float32)
    first = split * groups_per_split
    end = tl.minimum(first + groups_per_split, col_groups)
    group = row_group * col_groups + first
    words, group_values = _load_group(bitmap_ptr, offsets_ptr, values_ptr, group, GROUP, GROUP)
    for col_group in range(first, end):
        next_rows = tl.where(col_group + 1 < end, GROUP, 0)
        next_words, next_values = _load_group(bitmap_ptr, offsets_ptr, values_ptr, group + 1, next_rows,
                                              GROUP)
        w = _expand_group(words, group_values, GROUP)
        words, group_values, group = next_words, next_values, group + 1
        ks = col_group * GROUP + lanes
        x = tl.load(x_ptr + ms[:, None] * stride_xm + ks[None, :], mask=(ms[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
        if DOT_IN_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
    ns = row_group * GROUP + lanes
    ticket = ticket_ptr + row_group * tl.num_programs(1) + m_block
    _finish(acc, ms, ns, M, N, bias_ptr, out_ptr, stride_om, partial_ptr, ticket, split, n_splits, HAS_BIAS)


@triton.jit
def _tiled_bitmap_decode_kernel(bitmap_ptr, values_ptr, offsets_ptr, out_ptr, N, K, col_groups,
                                GROUP: tl.constexpr):
    row_group = tl.program_id(0)
    col_group = tl.program_id(1)
    words, group_values = _load_group(bitmap_ptr, offsets_ptr, values_ptr, row_group * col_groups + col_group,
                                      GROUP, GROUP)
    w = _expand_group(words, group_values, GROUP)
    lanes = tl.arange(0, GROUP)
    ns = row_group * GROUP + lanes
    ks = col_group * GROUP + lanes
    tl.store(out_ptr + ns[:, None] * K + ks[None, :], w, mask=(ns[:, None] < N) & (ks[None, :] < K))


def _shape(tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    shape = tensors["shape"]
    if shape.device.type != "cpu":  # reading it would sync the GPU, and fail inside CUDA-graph capture
        raise ValueError(f"tiled-bitmap tensors['shape'] must stay on the CPU, it is on {shape.device}")
    rows, cols = shape.tolist()
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


_TICKETS: dict[torch.device, torch.Tensor] = {}


def _tickets(device: torch.device, count: int) -> torch.Tensor:
    """Split-K ticket counters, zero between calls (the last split of each tile resets its own).

    Kept per device and reused, so that a call allocates and clears nothing; calls on one device must
    therefore not run concurrently on different streams. Warm up before CUDA-graph capture so that the
    counters are not allocated inside a graph's private pool."""
    tickets = _TICKETS.get(device)
    if tickets is None or tickets.numel() < count:
        tickets = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _TICKETS[device] = tickets
    return tickets


def _block_m(m: int) -> int:
    return 1 if m == 1 else min(max(16, triton.next_power_of_2(m)), 128)


def _split_k(col_groups: int, tiles: int, device: torch.device) -> int:
    """Enough programs to keep every SM busy with several (memory latency hides behind other programs),
    but at least two column groups per program."""
    wanted = triton.cdiv(8 * _sm_count(device), max(tiles, 1))
    return max(1, min(wanted, col_groups // 2))


def tiled_bitmap_linear(x: torch.Tensor, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None = None,
                        *, block_m: int | None = None, split_k: int | None = None,
                        num_warps: int | None = None) -> torch.Tensor:
    """y = x W^T (+ bias) for x [..., K] and W [N, K] in `tiled-bitmap`; y [..., N] in x's dtype.

    The keyword-only arguments override the launch heuristics (tests and benchmark sweeps use them)."""
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
        return torch.nn.functional.linear(x, tiled_bitmap_decode(tensors), bias)
    if m == 0 or rows == 0 or values.numel() == 0:  # nothing to multiply (and no empty tensors to launch on)
        y = x2.new_zeros(m, rows)
        return (y if bias is None else y + bias).reshape(*lead, rows)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    row_groups, col_groups = tensors["bitmap"].shape[:2]
    block = block_m or _block_m(m)
    m_blocks = triton.cdiv(m, block)
    splits = split_k or _split_k(col_groups, row_groups * m_blocks, x2.device)
    groups_per_split = triton.cdiv(col_groups, splits)
    splits = triton.cdiv(col_groups, groups_per_split)
    y = torch.empty(m, rows, dtype=x.dtype, device=x.device)
    partial = torch.empty(splits if splits > 1 else 0, m, rows, dtype=torch.float32, device=x.device)
    tickets = _tickets(x2.device, row_groups * m_blocks)
    operands = (x2, tensors["bitmap"], values, tensors["group_offsets"], y if bias is None else bias, y,
                partial, tickets)
    if block == 1:
        _tiled_bitmap_gemv_kernel[(row_groups, splits)](
            *operands, rows, cols, col_groups, groups_per_split, splits, HAS_BIAS=bias is not None,
            GROUP=GROUP, num_warps=num_warps or 4)
    else:
        # numpy has no bf16: the interpreter's dot would multiply the raw bit patterns, so upcast there.
        _tiled_bitmap_mm_kernel[(row_groups, m_blocks, splits)](
            *operands, m, rows, cols, col_groups, groups_per_split, splits, x2.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=block,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            DOT_IN_FP32=_INTERPRET and x.dtype == torch.bfloat16, GROUP=GROUP,
            num_warps=num_warps or (8 if block >= 64 else 4))
    return y.reshape(*lead, rows)


__all__ = ["SPARSE_KERNEL_MAX_M", "tiled_bitmap_decode", "tiled_bitmap_linear"]
