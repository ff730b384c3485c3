"""serving.huge_pages: the copy is exact, 2 MiB-aligned and advised where it spans a huge page, and the
tensor comes back unchanged where there is nothing to gain or it is switched off."""

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


def test_small_or_off_comes_back_unchanged(monkeypatch):
    small = torch.ones(HUGE_PAGE // 2 - 1, dtype=torch.uint8)
    assert huge_page_copy(small) is small
    monkeypatch.setenv(huge_pages.ENV, "0")
    big = torch.ones(HUGE_PAGE, dtype=torch.uint8)
    assert not huge_pages.enabled() and huge_page_copy(big) is big
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
