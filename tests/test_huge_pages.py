"""serving.huge_pages: the copy is exact, 2 MiB-aligned and advised where it spans a huge page, smaller
tensors share an advised arena, and the tensor comes back unchanged where it cannot be copied or the copy
is switched off."""

import sys

import pytest
import torch

from serving import huge_pages
from serving.huge_pages import HUGE_PAGE, huge_page_copy

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="madvise(MADV_HUGEPAGE) is Linux's")


@linux_only
@pytest.mark.parametrize(("dtype", "shape"), [(torch.uint8, (3 * HUGE_PAGE + 123,)),
                                              (torch.float16, (2048, 1024 + 32)), (torch.int32, (1 << 20,))])
def test_copy_is_exact_and_aligned(dtype, shape):
    tensor = (torch.arange(torch.Size(shape).numel()) % 251).to(dtype).view(shape)
    copy = huge_page_copy(tensor)
    assert copy.data_ptr() != tensor.data_ptr() and copy.data_ptr() % HUGE_PAGE == 0
    assert copy.dtype == dtype and copy.shape == tensor.shape and copy.is_contiguous()
    assert torch.equal(copy, tensor)


def test_small_tensors_share_an_arena(monkeypatch):
    if not huge_pages.enabled():
        pytest.skip("no madvise here")
    monkeypatch.setattr(huge_pages, "_arena", {"buffer": None, "used": 0})  # a fresh arena
    small = [(torch.arange(n) % 251).to(torch.uint8) for n in (HUGE_PAGE // 2 - 1, 1000, 77)]
    copies = [huge_page_copy(t) for t in small]
    for tensor, copy in zip(small, copies, strict=True):
        assert copy.data_ptr() != tensor.data_ptr() and copy.data_ptr() % 64 == 0
        assert torch.equal(copy, tensor)
    # one after the other in the same mapping, each on its own cache line
    assert copies[1].data_ptr() - copies[0].data_ptr() == -(-(HUGE_PAGE // 2 - 1) // 64) * 64
    half = torch.ones(HUGE_PAGE // 2, dtype=torch.float16).view(-1, 64)  # a dtype wider than a byte
    assert torch.equal(huge_page_copy(half), half)


def test_off_or_strided_comes_back_unchanged(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "0")
    big, small = torch.ones(HUGE_PAGE, dtype=torch.uint8), torch.ones(77, dtype=torch.uint8)
    assert not huge_pages.enabled() and huge_page_copy(big) is big and huge_page_copy(small) is small
    strided = torch.ones(2, HUGE_PAGE, dtype=torch.uint8).t()
    monkeypatch.delenv(huge_pages.ENV)
    assert huge_page_copy(strided) is strided


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "never"
    return text[text.index("[") + 1:text.index("]")]


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        first = line.split()[0]
        if "-" in first and ":" not in first:
            start, end = (int(part, 16) for part in first.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@linux_only
@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off")
def test_copy_lands_on_huge_pages_and_the_process_total_counts_them():
    before = huge_pages.huge_page_bytes()
    tensor = torch.ones(8 * HUGE_PAGE, dtype=torch.uint8)
    copy = huge_page_copy(tensor)
    landed = _anon_huge_kib(copy.data_ptr())
    assert landed >= 4 * HUGE_PAGE // 1024  # most of it: khugepaged aside
    assert huge_pages.huge_page_bytes() - before >= landed * 1024  # the rollup holds this mapping's pages
    # a tensor under a huge page goes into an arena whose pages are advised as a whole: on a huge page too
    small = huge_page_copy(torch.ones(HUGE_PAGE // 4, dtype=torch.uint8))
    assert _anon_huge_kib(small.data_ptr()) >= HUGE_PAGE // 1024
