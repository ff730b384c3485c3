"""Sparse layers' CPU weights on transparent huge pages (2 MiB) where Linux offers them.

One decode step streams every layer's weights once (470 MB for the Llama-3.2-1B shape at 50% in bitmap-q4),
more than any cache holds. On 4 KiB pages that is a TLB miss and page walk every 4 KiB of each stream. On
this machine kind (AMD EPYC, THP `madvise`, which torch's allocator never asks for), that model's decode
step of one sequence in vLLM, worker on one core: 38.4 ms on 4 KiB pages, 35.6 ms on huge pages (one
process, compiled, the two interleaved six times, every round 2.5-3.5 ms faster); through `leapctl serve`'s
server (all its processes on one core), 43.1 / 43.5 ms against 39.1 / 40.5 ms, the same greedy tokens and
the same peak RSS.

`huge_page_copy(t)` copies a tensor of a huge page or more into a fresh private anonymous mapping whose whole
2 MiB pages are `madvise(MADV_HUGEPAGE)`d before anything touches them, so the kernel backs them with huge
pages when it faults them in; its ragged end stays on 4 KiB pages, so resident memory grows by nothing.
Smaller tensors (the 1B shape's q/k/v and o layers, every layer's scales and zero points) share 32 MiB arenas
advised the same way: before, they stayed on 4 KiB pages, and the worker held 328 MiB on huge pages of the 60%
model's ~460 MiB. Measured (`python -m bench.kernels --format bitmap-q4 --phase step` on the 1B shape's 60%
asymmetric export, huge pages, int8 x, core 0, 7 runs alternating by process): cold 13.14-13.66 ms a step
against 13.30-14.08, lower in every pair by 0.16-0.52 ms; hot the same. Other devices, non-contiguous tensors,
systems without madvise and `LEAP_SPARSE_HUGE_PAGES=0` get the tensor back unchanged."""

import ctypes
import ctypes.util
import mmap
import os
import sys

import torch

HUGE_PAGE = 2 << 20
ENV = "LEAP_SPARSE_HUGE_PAGES"
_MADV_HUGEPAGE = 14  # Linux, every architecture

_madvise = None  # libc's madvise, looked up once; False where there is none


def enabled() -> bool:
    """Whether `huge_page_copy` copies (Linux, and LEAP_SPARSE_HUGE_PAGES is not 0)."""
    on = sys.platform.startswith("linux") and os.environ.get(ENV, "1") != "0"
    return on and _libc_madvise() is not None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        try:
            function = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
            function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            function.restype = ctypes.c_int
            _madvise = function
        except (OSError, AttributeError):
            _madvise = False
    return _madvise or None


def huge_page_bytes() -> int | None:
    """Bytes of this process's anonymous memory on huge pages (/proc/self/smaps_rollup), None where Linux does
    not say. The advice is a request: with memory fragmented the kernel may fault in small pages instead, and
    a decode step then streams its weights ~8% slower, so the server's load line reports what it got."""
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _advised(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` at a 2 MiB boundary of a fresh private anonymous mapping, its whole huge
    pages advised before anything touches them (torch.empty may reuse heap memory already faulted in on small
    pages; Python's default, a shared mapping, is shmem, which THP's `madvise` mode leaves on small pages).
    The tensor keeps the mapping alive."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -buffer.data_ptr() % HUGE_PAGE
    # An error (THP compiled out: EINVAL) only leaves the pages small.
    _libc_madvise()(buffer.data_ptr() + offset, nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)
    return buffer[offset:offset + nbytes]


ARENA_BYTES = 16 * HUGE_PAGE  # tensors under a huge page share mappings of this size
_ALIGN = 64  # a cache line: each tensor in an arena starts on one
_arena: dict = {"buffer": None, "used": 0}


def _from_arena(nbytes: int) -> torch.Tensor:
    """`nbytes` of the current arena, a fresh one when it is full (the rest of the old one is never touched,
    so never resident)."""
    if _arena["buffer"] is None or _arena["used"] + nbytes > ARENA_BYTES:
        _arena["buffer"], _arena["used"] = _advised(ARENA_BYTES), 0
    start = _arena["used"]
    _arena["used"] = start + -(-nbytes // _ALIGN) * _ALIGN
    return _arena["buffer"][start:start + nbytes]


def huge_page_copy(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (contiguous, CPU) copied onto huge pages: its own mapping from a huge page up (its ragged end
    stays on 4 KiB pages, so resident memory grows by nothing), else a share of an arena (see the module's
    docstring). Other devices, non-contiguous tensors and switched off: `tensor` itself."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or nbytes == 0 or not tensor.is_contiguous() or not enabled():
        return tensor
    place = _advised(nbytes) if nbytes >= HUGE_PAGE else _from_arena(nbytes)
    copy = place.view(tensor.dtype).view(tensor.shape)
    copy.copy_(tensor)
    return copy
