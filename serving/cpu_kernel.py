"""The native CPU sparse linear kernel (C++ in `serving/csrc`): built once into a cache folder, loaded as
the torch op `torch.ops.leap_sparse_cpu.bitmap_linear(x, bitmap, values, row_offsets, n_cols, bias,
checked=False)` and the bitmap-q4 and int8-rows ops beside it. Every op that follows offsets into a packed
tensor (`bitmap_linear`, `bitmap_q4_linear`, `bitmap_q4_pack_pairs`, `bitmap_q4_i8_linear`) checks them
against the bitmap (the masks) on each call, a RuntimeError naming a wrong one; `checked=True` skips that
pass, for a caller that checked the weight once (the vLLM layer does at load).

The op reads the `bitmap` serving layout as stored (no repacking), so tensor-parallel slices and
`leapctl validate` use the same tensors; so do the bitmap-q4 ops, but for the int8-x op
`bitmap_q4_i8_linear` (AVX-512 VNNI only), which reads a layout made at load (`serving.q4_linear.Q4Pairs`).
It picks its instruction set at run time: AVX-512 (with VBMI2's expand and BF16's dot products) where the
CPU has it, else AVX2; `LEAP_SPARSE_CPU_ISA=avx2` (or `avx512`, `auto`) chooses, which is how the tests
cover both paths on one machine.

The build (g++ and ninja through `torch.utils.cpp_extension`, about half a minute) happens at most once
per source version: into `$TORCH_EXTENSIONS_DIR` if set, else `$LEAPCTL_CACHE/torch_extensions` (default
`~/.cache/leapctl`), in a folder named after a hash of the sources, flags and torch version, under a file
lock because vLLM starts several processes at once. `make` builds it ahead (`python -m serving.cpu_kernel`);
`leap_sparse` layers load it when the model loads, never during a request. Where it cannot be built or
loaded (no x86-64, no compiler), `load()` returns False and `unavailable_reason()` says why."""

import fcntl
import hashlib
import os
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

ISA_ENV = "LEAP_SPARSE_CPU_ISA"
ISAS = ("avx512", "avx2")  # fastest first
CSRC = Path(__file__).resolve().parent / "csrc"
# One folder per layout (its op, its AVX-512 and AVX2 kernels), common/ for what they share (the library and
# its ISA set-up, the op helpers, the kernels' helpers, the offset checks); paths relative to CSRC, which is
# the include path ("bitmap_q4/kernels.h").
FORMATS = ("bitmap", "bitmap_q4", "bitmap_q4_i8", "int8_rows")
SOURCES = ("common/isa.cpp", *(f"{name}/{part}.cpp" for name in FORMATS for part in ("op", "avx512", "avx2")))
HEADERS = tuple(sorted(path.relative_to(CSRC).as_posix() for path in CSRC.rglob("*.h")))  # all in the hash
# -fno-tree-slp-vectorize: GCC's SLP pass packed the kernels' per-row value pointers into vector
# registers, putting vector extract/insert latency on the loop-carried pointer updates.
# -fopenmp: at::parallel_for is inline code that splits work only where _OPENMP is defined; without it
# every call ran on one thread whatever torch.set_num_threads said. The extension then shares torch's
# libgomp.so.1 (same soname, already loaded), so torch's thread count holds for it too.
CFLAGS = ("-O3", "-fno-tree-slp-vectorize", "-fopenmp")

_status: tuple[bool, str] | None = None  # (loaded, why not)


def extension_name() -> str:
    """`leap_sparse_cpu_<hash>`: a new build folder whenever a source, a flag or torch changes."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update(name.encode() + b"\0" + (CSRC / name).read_bytes())
    digest.update(" ".join(CFLAGS).encode() + torch.__version__.encode())
    return f"leap_sparse_cpu_{digest.hexdigest()[:12]}"


def build_dir() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        cache = os.environ.get("LEAPCTL_CACHE", str(Path.home() / ".cache" / "leapctl"))
        root = str(Path(cache).expanduser() / "torch_extensions")
    return Path(root) / extension_name()


def load(verbose: bool = False) -> bool:
    """Build (once per source version) and load the op; True when it is ready. Repeated calls are free.
    Raises ValueError when LEAP_SPARSE_CPU_ISA names no kernel or one this CPU cannot run."""
    global _status
    if _status is None:
        _status = _build_and_load(verbose)
    return _status[0]


def unavailable_reason() -> str:
    """Why `load()` returned False ('' when it did not)."""
    return "" if _status is None else _status[1]


def requested_isa() -> str:
    """`LEAP_SPARSE_CPU_ISA` (default auto); ValueError when it names no kernel."""
    wanted = os.environ.get(ISA_ENV, "auto")
    if wanted not in ("auto", *ISAS):
        raise ValueError(f"{ISA_ENV}={wanted!r}: use auto, {' or '.join(ISAS)}")
    return wanted


def _build_and_load(verbose: bool) -> tuple[bool, str]:
    wanted = requested_isa()
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False, f"the kernel needs an x86-64 CPU, this is {platform.machine()}"
    try:
        from torch.utils import cpp_extension

        folder = build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "leapctl.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released by the OS if this process dies
            # torch's own lock file is left behind by a build that was killed, and would make every
            # later build wait forever; holding our lock, nobody else is building.
            (folder / "lock").unlink(missing_ok=True)
            cpp_extension.load(name=extension_name(), sources=_units(folder), extra_cflags=list(CFLAGS),
                               extra_ldflags=["-fopenmp"], extra_include_paths=[str(CSRC)],
                               build_directory=str(folder), verbose=verbose, is_python_module=False)
    except Exception as exc:  # a missing compiler, a failed build, an unloadable library
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return False, f"building it failed ({type(exc).__name__}: {first_line})"
    _register_fake()
    isa = torch.ops.leap_sparse_cpu.isa()
    if isa == "none":
        return False, "this CPU has neither AVX-512 (with VBMI2 and BF16) nor AVX2 with FMA and F16C"
    try:
        torch.ops.leap_sparse_cpu.set_isa(wanted)
    except RuntimeError as exc:
        raise ValueError(f"{ISA_ENV}={wanted}: {exc}") from None
    return True, ""


def _units(folder: Path) -> list[str]:
    """One file in the build folder per source, named after its path (`bitmap_q4/op.cpp` ->
    `bitmap_q4_op.cpp`) and including it: torch names each object after its source's file name, and every
    layout has an op.cpp."""
    units = []
    for source in SOURCES:
        unit = folder / source.replace("/", "_")
        text = f'#include "{source}"  // serving/csrc/{source}\n'
        if not unit.exists() or unit.read_text() != text:
            unit.write_text(text)
        units.append(str(unit))
    return units


def _register_fake() -> None:
    """Shapes for torch.compile, which then keeps the op as one opaque call."""

    @torch.library.register_fake("leap_sparse_cpu::bitmap_linear")
    def _(x, bitmap, values, row_offsets, n_cols, bias=None, checked=False):
        return x.new_empty((*x.shape[:-1], bitmap.shape[0]))

    @torch.library.register_fake("leap_sparse_cpu::bitmap_q4_linear")
    def _q4(x, bitmap, codes, scales, row_offsets, n_cols, bias=None, zeros=None, checked=False):
        return x.new_empty((*x.shape[:-1], bitmap.shape[0]))

    @torch.library.register_fake("leap_sparse_cpu::bitmap_q4_i8_linear")
    def _q4_i8(x, masks, codes, block_offsets, scales, n_rows, n_cols, bias=None, zeros=None, checked=False):
        return x.new_empty((*x.shape[:-1], n_rows))

    @torch.library.register_fake("leap_sparse_cpu::int8_rows_linear")
    def _int8_rows(x, qweight, scales, row_sums, bias=None):
        return x.new_empty((*x.shape[:-1], qweight.shape[0]))


def current_isa() -> str:
    """The instruction set the op uses now: 'avx512' or 'avx2' (after a successful `load()`)."""
    return torch.ops.leap_sparse_cpu.isa()


def int8_kernel_available() -> bool:
    """Whether bitmap-q4 layers can multiply int8 x natively (`bitmap_q4_i8_linear`): the op loaded, and
    the avx2 kernels chosen or the avx512 ones on a CPU with AVX-512 VNNI and VBMI2, and GFNI."""
    return load() and torch.ops.leap_sparse_cpu.bitmap_q4_i8_available()


def int8_rows_kernel_available() -> bool:
    """Whether an int8-rows lm_head can multiply decoding steps natively (`int8_rows_linear`): the op
    loaded, a CPU with AVX-512 VNNI, and the avx512 kernels chosen."""
    return load() and torch.ops.leap_sparse_cpu.int8_rows_available()


def supported_isas() -> list[str]:
    """The instruction sets this CPU can run, fastest first."""
    with using_isa("auto") as best:
        return list(ISAS[ISAS.index(best):])


@contextmanager
def using_isa(name: str) -> Iterator[str]:
    """Run the op with `name` ('auto', 'avx512', 'avx2') inside the block; yields the one in use."""
    previous = current_isa()
    try:
        yield torch.ops.leap_sparse_cpu.set_isa(name)
    finally:
        torch.ops.leap_sparse_cpu.set_isa(previous)


def main() -> int:
    """`python -m serving.cpu_kernel`: build ahead of time (the README set-up runs it) and report."""
    if not load(verbose="-v" in sys.argv):
        print(f"leap_sparse: native CPU kernel unavailable: {unavailable_reason()}; serving falls back to "
              f"decoding weights per call")
        return 0
    print(f"leap_sparse: native CPU kernel ready ({current_isa()}; {', '.join(supported_isas())} supported) "
          f"in {build_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
