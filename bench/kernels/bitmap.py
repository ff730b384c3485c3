"""The native CPU sparse linear kernel against the fastest dense op at the same dtype, side by side.

    python -m bench.kernels --format bitmap --phase decode [--models SmolLM2-135M Qwen2.5-0.5B Llama-3-8B]
        [--sparsities 0.5 0.6 0.7] [--tokens 1 2 4 8 16] [--threads 1 2] [--dtypes bf16] [--repeats 15]
        [--rotate-mib 256] [--quick] [--out bench/results/kernels/cpu_kernels]

For every decoder linear of each model as vLLM computes it (q/k/v merged into qkv, gate/up into gate_up,
then o and down), each sparsity, M rows of x and thread count, it times on the same masked weight:
- sparse: `torch.ops.leap_sparse_cpu.bitmap_linear` on the `bitmap` encoding (what `leapctl serve` runs);
- `torch.nn.functional.linear` on the dense masked weight;
- vLLM's CPU dense path, oneDNN (`vllm._custom_ops.create_onednn_mm` + `onednn_mm`, as
  `dispatch_cpu_unquantized_gemm` sets it up on this machine).
The speed-up is against the faster dense op. Decode reads every weight from DRAM (a model's weights do
not fit in the 32 MiB L3), so each timing cycles through copies of the weight, dense and sparse alike,
that together hold at least --rotate-mib MiB of dense weights; the three ops take turns repetition by
repetition, so that load from other processes on the machine hits them alike, and the figure is the
median time per call. Weights are random (the kernel's speed depends on the density, not the values);
masks are unstructured, the same density in every row, as Wanda's are.

bandwidth_fraction = bytes the sparse call reads (bitmap + values) / its time / the read bandwidth that
`torch.sum` reaches over 512 MiB with the same thread count, measured in the same run.

Writes OUT.json (one row per measurement: device, model, layer, shape [n, k], m, sparsity, dtype,
threads, dense_us, linear_us, onednn_us, dense_op, sparse_us, speedup, bandwidth_fraction, plus the
settings, the read bandwidths and the load average before and after) and OUT.md (the tables).
"""

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.harness import RESULTS, device_name, geomean, onednn_ops, read_bandwidth, write_results
from bench.shapes import merged_shapes
from serving import cpu_kernel
from sparse_formats import get_format

MODELS = ("SmolLM2-135M", "Qwen2.5-0.5B", "Llama-3-8B")  # shapes from bench/shapes.py
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
layer_shapes = merged_shapes


def make_weights(n: int, k: int, sparsity: float, dtype: torch.dtype, copies: int, seed: int):
    """`copies` dense masked weights and their bitmap encodings (separate memory, equal contents)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    mask = torch.rand(n, k, generator=gen).argsort(dim=1) >= round(k * sparsity)  # exact per row
    dense = torch.where(mask, weight, torch.zeros((), dtype=dtype))
    encoded = get_format("bitmap").encode(weight, mask)
    sparse = (encoded["bitmap"], encoded["values"], encoded["row_offsets"])
    return ([dense.clone() for _ in range(copies)], [tuple(t.clone() for t in sparse) for _ in range(copies)])


def time_ops(ops: dict, repeats: int, copies: int) -> dict[str, float]:
    """Median microseconds per call of each op (a callable that runs the op once on every copy)."""
    for run in ops.values():  # warm-up: page in the copies, build oneDNN primitives
        run()
    samples = {name: [] for name in ops}
    for _ in range(repeats):
        for name, run in ops.items():
            start = time.perf_counter()
            run()
            samples[name].append((time.perf_counter() - start) / copies * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def measure_layer(args, onednn, bandwidth: dict, model: str, layer: str, n: int, k: int, dtype_name: str,
                  sparsity: float, copies: int) -> list[dict]:
    dtype = DTYPES[dtype_name]
    dense, sparse = make_weights(n, k, sparsity, dtype, copies, seed=n * 31 + k)
    handlers = [onednn[0](w.t(), 32) for w in dense] if onednn and dtype != torch.float16 else []
    sparse_bytes = sum(t.numel() * t.element_size() for t in sparse[0][:2])
    sparse_op = torch.ops.leap_sparse_cpu.bitmap_linear
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for m in args.tokens:
            x = torch.randn(m, k).to(dtype)
            ref = F.linear(x, dense[0]).float()
            got = torch.ops.leap_sparse_cpu.bitmap_linear(x, *sparse[0], k, None).float()
            tol = 1e-3 if dtype == torch.float32 else 3e-2
            assert torch.allclose(got, ref, rtol=tol, atol=tol * ref.abs().max().item()), \
                f"sparse and dense disagree for {model} {layer} M={m}"
            # timed as the serving layer calls it: the weight's layout was checked (by the call above)
            ops = {"sparse": lambda x=x: [sparse_op(x, *s, k, None, checked=True) for s in sparse],
                   "linear": lambda x=x: [F.linear(x, w) for w in dense]}
            if handlers:
                ops["onednn"] = lambda x=x: [onednn[1](h, x, None) for h in handlers]
            us = time_ops(ops, args.repeats, copies)
            dense_op = min((name for name in us if name != "sparse"), key=us.get)
            rows.append({
                "device": args.device, "model": model, "layer": layer, "shape": [n, k], "m": m,
                "sparsity": sparsity, "dtype": dtype_name, "threads": threads,
                "dense_us": round(us[dense_op], 2), "linear_us": round(us["linear"], 2),
                "onednn_us": round(us["onednn"], 2) if "onednn" in us else None,
                "dense_op": dense_op, "sparse_us": round(us["sparse"], 2),
                "speedup": round(us[dense_op] / us["sparse"], 3),
                "bandwidth_fraction": round(sparse_bytes / (us["sparse"] * 1e-6) / bandwidth[threads], 3),
            })
            print(f"    {threads} thr M={m:2d}: dense {us[dense_op]:9.1f} us ({dense_op}), "
                  f"sparse {us['sparse']:9.1f} us, x{rows[-1]['speedup']:.2f}", flush=True)
    return rows


def measure(args, onednn) -> tuple[list[dict], dict]:
    rows, bandwidth = [], {t: read_bandwidth(t) for t in args.threads}
    total = len(args.models) * 4 * len(args.sparsities) * len(args.dtypes)
    done = 0
    for model in args.models:
        for layer, (n, k) in layer_shapes(model).items():
            for dtype_name in args.dtypes:
                copies = max(2, math.ceil(args.rotate_mib * 2**20 / (n * k * DTYPES[dtype_name].itemsize)))
                for sparsity in args.sparsities:
                    done += 1
                    print(f"[{done}/{total}] {model} {layer} {n}x{k} {dtype_name} {sparsity:.0%}: "
                          f"{copies} copies", flush=True)
                    rows += measure_layer(args, onednn, bandwidth, model, layer, n, k, dtype_name, sparsity,
                                          copies)
    return rows, bandwidth


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"Native CPU sparse kernel against the faster of F.linear and vLLM's oneDNN linear, same dtype, "
             f"{meta['device']}.", "",
             f"Median time per call over {meta['repeats']} repetitions, each cycling through at least "
             f"{meta['rotate_mib']} MiB of weights (DRAM, not cache). Load average (1 min) "
             f"{meta['load_before']:.2f} before, {meta['load_after']:.2f} after, on {os.cpu_count()} CPUs. "
             f"Read bandwidth (torch.sum): "
             + ", ".join(f"{t} thread{'s' if t > 1 else ''} {bw / 1e9:.1f} GB/s"
                         for t, bw in meta["read_bandwidth"].items()) + ".", ""]
    tokens = sorted({r["m"] for r in rows})
    for dtype in sorted({r["dtype"] for r in rows}):
        for threads in sorted({r["threads"] for r in rows}):
            subset = [r for r in rows if r["dtype"] == dtype and r["threads"] == threads]
            lines += [f"### {dtype}, {threads} thread{'s' if threads > 1 else ''}: speed-up over dense "
                      f"(geometric mean over all layers)", "",
                      "| sparsity | " + " | ".join(f"M={m}" for m in tokens) + " |",
                      "| --- |" + " --- |" * len(tokens)]
            for sparsity in sorted({r["sparsity"] for r in subset}):
                cells = [geomean([r["speedup"] for r in subset if r["sparsity"] == sparsity and r["m"] == m])
                         for m in tokens]
                lines.append(f"| {sparsity:.0%} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
            lines += ["", "| model | layer | [n, k] | sparsity | " + " | ".join(f"M={m}" for m in tokens)
                      + " | dense / sparse us at M=1 | bandwidth fraction at M=1 |",
                      "| --- | --- | --- | --- |" + " --- |" * len(tokens) + " --- | --- |"]
            keys = sorted({(r["model"], r["layer"], tuple(r["shape"]), r["sparsity"]) for r in subset},
                          key=lambda key: (list(MODELS).index(key[0]), key[3], key[2]))
            for key in keys:
                model, layer, shape, sparsity = key
                by_m = {r["m"]: r for r in subset
                        if (r["model"], r["layer"], tuple(r["shape"]), r["sparsity"]) == key}
                first = by_m[min(by_m)]
                lines.append(f"| {model} | {layer} | {list(shape)} | {sparsity:.0%} | "
                             + " | ".join(f"{by_m[m]['speedup']:.2f}" if m in by_m else "" for m in tokens)
                             + f" | {first['dense_us']:.1f} / {first['sparse_us']:.1f} | "
                               f"{first['bandwidth_fraction']:.2f} |")
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--sparsities", nargs="+", type=float, default=[0.5, 0.6, 0.7])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rotate-mib", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="SmolLM2-135M at 50%%, M 1 and 8, 7 repetitions")
    parser.add_argument("--out", default=str(RESULTS / "kernels" / "cpu_kernels"))
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.sparsities, args.tokens, args.repeats = ["SmolLM2-135M"], [0.5], [1, 8], 7
    if not cpu_kernel.load(verbose=True):
        sys.exit(f"the native kernel is unavailable: {cpu_kernel.unavailable_reason()}")
    if any(m > 40 for m in args.tokens):
        print("note: above 40 rows of x the op decodes tiles and runs ATen's dense GEMM")
    args.device = device_name()
    onednn = onednn_ops()
    if onednn is None:
        print("note: vLLM's oneDNN ops are not importable; the dense baseline is F.linear only")
    load_before = os.getloadavg()[0]
    rows, bandwidth = measure(args, onednn)
    meta = {"device": args.device, "repeats": args.repeats, "rotate_mib": args.rotate_mib,
            "load_before": load_before, "load_after": os.getloadavg()[0], "torch": torch.__version__,
            "read_bandwidth": bandwidth, "date": time.strftime("%Y-%m-%d %H:%M")}
    write_results(Path(args.out), meta, rows, markdown(rows, meta))


if __name__ == "__main__":
    main()
