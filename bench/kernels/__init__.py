"""One kernel against its dense baselines, chosen by format and phase:

    python -m bench.kernels --format FORMAT --phase PHASE [--isa auto|avx512|avx2] [the study's options]

| format | phase | what it times | module |
| --- | --- | --- | --- |
| bitmap | decode | the native bf16 op per decoder linear, M <= 16, against F.linear and oneDNN | `bitmap` |
| bitmap-q4 | decode | the 4-bit ops (bf16 x and int8 x) per linear, against bitmap and dense | `q4` |
| bitmap-q4 | decode, `--base REV` | two builds of the int8 op, alternated in fresh processes | `ab` |
| bitmap-q4 | prefill | M = 400 rows per projection, against F.linear and oneDNN | `prefill` |
| bitmap-q4 | step | every layer of an export in model order: a decode step's linears (EXPORT) | `step` |
| int8-rows | decode | the 8-bit lm_head op against vLLM's oneDNN int8 GEMM | `lm_head` |
| tiled-bitmap | decode | the GPU kernel against cuBLAS (CUDA) | `gpu` |
| tiled-bitmap | step | decode tokens/s of Llama-shaped models on the GPU (CUDA) | `gpu_step` |

`--isa` picks the native CPU kernel (LEAP_SPARSE_CPU_ISA) before anything loads it. Every study writes
OUT.json and OUT.md (default under bench/results/kernels/); `--format F --phase P --help` lists its
options."""

import argparse
import importlib
import os
import sys

STUDIES = {("bitmap", "decode"): "bitmap", ("bitmap-q4", "decode"): "q4",
           ("bitmap-q4", "prefill"): "prefill", ("bitmap-q4", "step"): "step",
           ("int8-rows", "decode"): "lm_head",
           ("tiled-bitmap", "decode"): "gpu", ("tiled-bitmap", "step"): "gpu_step"}
FORMATS = list(dict.fromkeys(f for f, _ in STUDIES))
PHASES = ("decode", "prefill", "step")


def study_for(fmt: str, phase: str, rest: list[str]) -> str | None:
    """The module that times `fmt` in `phase`: bitmap-q4 decode with `--base` is the two-build comparison."""
    two_builds = any(a == "--base" or a.startswith("--base=") for a in rest)
    if (fmt, phase) == ("bitmap-q4", "decode") and two_builds:
        return "ab"
    return STUDIES.get((fmt, phase))


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__, add_help=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", default="bitmap-q4", choices=FORMATS)
    parser.add_argument("--phase", default="decode", choices=PHASES)
    parser.add_argument("--isa", choices=("auto", "avx512", "avx2"), default=None,
                        help="the native CPU kernel to run (default: the environment's, else the best here)")
    known, rest = parser.parse_known_args(argv)
    if any(a in ("-h", "--help") for a in rest) and "--format" not in " ".join(argv):
        parser.print_help()
        return
    module = study_for(known.format, known.phase, rest)
    if module is None:
        parser.error(f"no study times {known.format} in {known.phase} "
                     f"(there are: {', '.join(f'{f} {p}' for f, p in STUDIES)})")
    if known.isa:
        os.environ["LEAP_SPARSE_CPU_ISA"] = known.isa
    sys.argv[0] = f"python -m bench.kernels --format {known.format} --phase {known.phase}"  # usage lines
    importlib.import_module(f"bench.kernels.{module}").main(rest)
