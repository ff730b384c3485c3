"""Sparse layers' CPU weights on transparent huge pages (2 MiB) where Linux offers them.

One decode step streams every layer's weights once (470 MB for the Llama-3.2-1B shape at 50% in bitmap-q4),
more than any cache holds. On 4 KiB pages that is a TLB miss and page walk every 4 KiB of each stream. On
this machine kind (AMD EPYC, THP `madvise`, which torch's allocator never asks for), that model's decode
step of one sequence in vLLM, worker on one core: 38.4 ms on 4 KiB pages, 35.6 ms on huge pages (one
process, compiled, the two interleaved six times, every round 2.5-3.5 ms faster); through `leapctl serve`'s
server (all its processes on one core), 43.1 / 43.5 ms against 39.1 / 40.5 ms, the same greedy tokens and
the same peak RSS.

`huge_page_copy(t)` copies a tensor into a fresh private anonymous mapping whose whole 2 MiB pages are
`madvise(MADV_HUGEPAGE)`d before anything touches them, so the kernel backs them with huge pages when it
faults them in. Only whole huge pages inside the tensor are advised (its ragged ends stay on 4 KiB pages),
so resident memory grows by nothing; the mapping's unused slack before the aligned start is never touched.
Tensors under 2 MiB, other devices, systems without madvise and `LEAP_SPARSE_HUGE_PAGES=0` get the tensor
back unchanged."""

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


def huge_page_copy(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (contiguous, CPU) copied onto huge pages where it spans at least one; else `tensor`."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or nbytes < HUGE_PAGE or not tensor.is_contiguous() or not enabled():
        return tensor
    # A fresh anonymous mapping, never touched before the advice (torch.empty may reuse heap memory that
    # is already faulted in on small pages: then only part of the weights went onto huge pages). The
    # tensor keeps the mapping alive.
    # Private: Python's default, a shared mapping, is shmem, which THP's `madvise` mode leaves on small pages.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    address = buffer.data_ptr()
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    # An error (THP compiled out: EINVAL) only leaves the pages small.
    _libc_madvise()(start, nbytes // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)
    offset = start - address
    copy = buffer[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
    copy.copy_(tensor)
    return copy
