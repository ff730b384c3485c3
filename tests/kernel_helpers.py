"""What the tests of the native CPU ops (test_cpu_kernel.py, test_cpu_kernel_q4.py, test_cpu_kernel_q4_i8.py)
share besides the `isa` and `threads` fixtures of conftest.py: the x86-64 mark, a child Python process, the
checks the ops pass alike (thread count, torch.compile) and the corrupted bitmap-q4 weights both 4-bit ops
must be seen to multiply wrongly."""

import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import pytest
import torch

X86_ONLY = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                              reason="the native kernel is built for x86-64 only")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextmanager
def under_isa(name: str, available: Callable[[], bool], missing: str) -> Iterator[None]:
    """Inside the block the native op runs its `name` kernels; the test is skipped where this CPU cannot
    run them, or where `available()` (the op's own check under that ISA) says no (reason: `missing`)."""
    from serving import cpu_kernel

    assert cpu_kernel.load(), cpu_kernel.unavailable_reason()
    if name not in cpu_kernel.supported_isas():
        pytest.skip(f"this CPU cannot run the {name} kernel")
    with cpu_kernel.using_isa(name):
        if not available():
            pytest.skip(missing)
        yield


def run_python(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`python -c code args...` in the repository, with its PYTHONPATH and `env` added."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": REPO, **env}, timeout=300)


def assert_threads_agree(multiply: Callable[[torch.Tensor], torch.Tensor], cols: int,
                         ms: Iterable[int]) -> None:
    """multiply(x) for bf16 x of each M in `ms` gives the same result on 1 and 2 threads, exactly."""
    before = torch.get_num_threads()
    try:
        for m in ms:
            x = torch.randn(m, cols).to(torch.bfloat16)
            torch.set_num_threads(1)
            one = multiply(x)
            torch.set_num_threads(2)
            assert torch.equal(multiply(x), one), m
    finally:
        torch.set_num_threads(before)


def assert_opaque_under_compile(op, args: tuple, multiply: Callable[[torch.Tensor], torch.Tensor],
                                dense: torch.Tensor,
                                rounded: Callable[[torch.Tensor], torch.Tensor] = lambda x: x) -> None:
    """The op's schema and fake pass torch's opcheck (args: one call's arguments), and relu(multiply(x))
    compiled with a dynamic M in one graph matches relu(rounded(x) @ dense^T) (`rounded`: x as the op
    multiplies it)."""
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))

    def layer(x):
        return torch.relu(multiply(x))

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    for m in (3, 5):
        x = torch.randn(m, dense.shape[1])
        torch.testing.assert_close(compiled(x), torch.relu(rounded(x) @ dense.T))


def corrupted_q4(t: dict[str, torch.Tensor], dense: torch.Tensor):
    """(flipped, rescaled, x_for) for a bitmap-q4 weight of at least 7 rows and 256 columns in groups of 64
    (`dense`: it decoded): one code's top bit flipped in row 4 (8 levels), group 3's scale of row 6 doubled,
    and x_for(m), seeded bf16 rows of x that are large where those changes act (a random x near 0 there, or
    a group summing to near 0, could hide them inside an error bound)."""
    from sparse_formats import get_format

    flipped = dict(t, codes=t["codes"].clone())
    flipped["codes"][int(t["row_offsets"][4]) + 5] ^= 0x80
    rescaled = dict(t, scales=t["scales"].clone())
    rescaled["scales"][6, 3] *= 2
    flipped_column = int((get_format("bitmap-q4").decode(flipped) != dense)[4].nonzero()[0, 0])

    def x_for(m: int) -> torch.Tensor:
        x = torch.randn(m, dense.shape[1], generator=torch.Generator().manual_seed(m))
        x[:, flipped_column] = 4.0
        x[:, 192:256] = 2 * dense[6, 192:256].sign()
        return x.to(torch.bfloat16)

    return flipped, rescaled, x_for
