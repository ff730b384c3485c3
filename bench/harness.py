"""What every benchmark shares: where results go, the machine and load line, timing helpers, the JSON and
Markdown writers, and the dispatch of an entry point's studies (`python -m bench.quality grid ...`).

Run every entry point from the repository root as a module (`python -m bench.kernels --help`): nothing here
edits `sys.path`, and every path is found relative to this file (the competitors' virtual environment too:
`bench/competitors.py`)."""

import argparse
import importlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
READ_BYTES = 512 * 2**20


def results(topic: str, stem: str = "") -> Path:
    """bench/results/TOPIC[/STEM]: one folder per topic, the latest table and its JSON in it."""
    return RESULTS / topic / stem if stem else RESULTS / topic


def work_dir(name: str) -> Path:
    """$LEAPCTL_CACHE/bench/NAME (default ~/.cache/leapctl): where a benchmark keeps models it made."""
    cache = Path(os.environ.get("LEAPCTL_CACHE", Path.home() / ".cache" / "leapctl"))
    return cache / "bench" / name


# ---------------------------------------------------------------------------------------------- machine


def device_name() -> str:
    """The CPU's model name, core count, architecture and the native kernel's ISA."""
    from serving import cpu_kernel

    model = "CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores, {platform.machine()}, kernel {cpu_kernel.current_isa()})"


def load_average() -> float:
    """The 1-minute load average: recorded before and after every run (others share the machine)."""
    return os.getloadavg()[0]


def machine_line(device: str, load_before: float, load_after: float, date: str | None = None) -> str:
    """One line saying what ran where and how busy the machine was."""
    when = f", {date}" if date else ""
    return (f"{device}{when}; load average (1 min) {load_before:.2f} before, {load_after:.2f} after, on "
            f"{os.cpu_count()} CPUs.")


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M")


def read_bandwidth(threads: int, read_bytes: int = READ_BYTES, warm_up: bool = False) -> float:
    """Bytes/s that torch.sum reads from a buffer far larger than the L3 (`read_bytes` of fp32), with
    `threads` threads; the median of 7 sums (after one more, untimed, with `warm_up`)."""
    torch.set_num_threads(threads)
    buffer = torch.ones(read_bytes // 4)
    if warm_up:
        buffer.sum()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return read_bytes / statistics.median(times)


def onednn_ops():
    """vLLM's oneDNN dense linear (create, run), or None where vLLM's CPU ops are not installed or cannot
    make a bf16 matmul on this CPU (none without AVX-512: "could not create a primitive descriptor")."""
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return None
    if not getattr(ops, "_supports_onednn", False):
        return None
    try:
        ops.onednn_mm(ops.create_onednn_mm(torch.ones(64, 64, dtype=torch.bfloat16).t(), 32),
                      torch.ones(1, 64, dtype=torch.bfloat16), None)
    except RuntimeError:
        return None
    return ops.create_onednn_mm, ops.onednn_mm


def geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


# ---------------------------------------------------------------------------------------------- GPU timing


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def require_cuda_and_triton(script: str) -> None:
    """Exit with one line when the machine cannot run a GPU benchmark."""
    if not torch.cuda.is_available():
        fail(f"{script} needs a CUDA GPU (torch.cuda.is_available() is False)")
    try:
        import triton  # noqa: F401
    except ImportError:
        fail(f"{script} needs triton")


def median_graph_ms(body: Callable[[], None], *, warmup: int = 1, replays: int = 1, reps: int = 15,
                    reset: Callable[[], None] | None = None) -> float:
    """Median milliseconds per replay of a CUDA graph of `body`, over `reps` samples of `replays` replays.

    Replaying a captured graph keeps Python's launch overhead out, which is how vLLM runs decode steps too.
    `body` first runs `warmup` times on a side stream (Triton compilation, split-K counters, cuBLAS
    workspaces), then is captured once; `reset` runs before each sample (e.g. to rewind a KV position)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        if reset is not None:
            reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / replays)
    del graph
    return statistics.median(samples)


# ---------------------------------------------------------------------------------------------- writers


def write_report(out: Path, result: dict, table: str) -> None:
    """OUT.json (the result) and OUT.md (its table, also printed)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


def write_results(out: Path, meta: dict, rows: list[dict], table: str) -> None:
    """OUT.json ({"meta", "rows"}) and OUT.md (the table, also printed)."""
    write_report(out, {"meta": meta, "rows": rows}, table)


# ---------------------------------------------------------------------------------------------- dispatch


def run_study(package: str, studies: dict[str, str], argv: list[str] | None, doc: str) -> None:
    """`python -m bench.PACKAGE STUDY [options]`: STUDY's module main(options); `--help` alone lists them."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in studies:
        parser = argparse.ArgumentParser(prog=f"python -m bench.{package}", description=doc,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("study", choices=list(studies),
                            help="then the study's own options (STUDY --help)")
        parser.parse_args(argv[:1] or ["--help"])
        return
    module = importlib.import_module(f"bench.{package}.{studies[argv[0]]}")
    sys.argv[0] = f"python -m bench.{package} {argv[0]}"  # argparse's prog in the study's usage line
    module.main(argv[1:])
