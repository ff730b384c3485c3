"""What the GPU benchmarks (kernels.py, decode_e2e.py) share: the start-up check and CUDA-graph timing.

Timing replays a captured graph so that launch overhead from Python does not count, which is how vLLM
runs decode steps too."""

import statistics
import sys
from collections.abc import Callable
from typing import NoReturn

import torch


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
