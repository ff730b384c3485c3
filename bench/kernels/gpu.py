"""Sparse tiled-bitmap kernel against cuBLAS on the dense masked weight, side by side in one run (GPU only).

    python -m bench.kernels --format tiled-bitmap --phase decode [--dtype float16|bfloat16] [--peak-tbps 3.35]
        [--quick]

For every Llama-3.1-8B and Llama-3.2-1B projection shape, sparsity 50/60/70% and M tokens in
1..128 it times `tiled_bitmap_linear` and `torch.matmul(x, W.T)` on the same masked weight, after
checking that they agree. Timing: each measurement is a CUDA graph that calls the op once on each of
several copies of the weight (together far larger than L2, so every call reads its weight from HBM),
replayed 15 times under CUDA events; the figure is the median time per call. The weights are random
(only the sparsity pattern's density matters to the kernel) and made on the GPU machine itself.

Writes bench/results/kernels/kernels_<device>_<date>.json (one row per measurement: device, shape [n, k], m,
sparsity, dtype, dense_us, sparse_us (what `tiled_bitmap_linear` dispatches to), speedup,
bandwidth_fraction = bytes the sparse call must move / time / peak HBM bandwidth; plus fallback_us:
expand to dense + cuBLAS, and kernel_us: the sparse kernel even above SPARSE_KERNEL_MAX_M; at 50% also
M = 256, 1024, 4096, which is where that threshold is read off), a PNG plot of speed-up against M,
and a split-K x num_warps sweep at M = 1 (<...>_splits.json) to tune the launch heuristic.
"""

import argparse
import datetime
import json
import math
import re
from functools import partial
from pathlib import Path

import torch

from bench.harness import RESULTS, fail, median_graph_ms, require_cuda_and_triton
from bench.shapes import linear_shapes
from leapctl.compute import dtype_from_name

SHAPES = {model: linear_shapes(model) for model in ("Llama-3.1-8B", "Llama-3.2-1B")}  # [n, k] = [out, in]
TOKENS = [1, 2, 4, 8, 16, 32, 64, 128]
PREFILL_TOKENS = [256, 1024, 4096]  # at 50% only: where the dispatcher's dense fallback takes over
SPARSITIES = [0.5, 0.6, 0.7]
ROTATION_BYTES = 400 * 2**20  # weights cycled per graph; the H100/H200 L2 is 50-60 MB
PEAK_TBPS = [("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35)]  # first match wins


def peak_tbps(device_name: str, override: float | None) -> float:
    if override:
        return override
    for key, tbps in PEAK_TBPS:
        if key in device_name:
            return tbps
    fail(f"no known peak memory bandwidth for {device_name!r}; pass --peak-tbps")
    raise AssertionError


def time_per_call(calls: list) -> float:
    """Median microseconds per call of a CUDA graph that runs `calls` once each."""

    def run_all() -> None:
        for call in calls:
            call()

    return median_graph_ms(run_all) * 1000 / len(calls)


def make_weights(n: int, k: int, sparsity: float, dtype: torch.dtype):
    from sparse_formats import get_format

    weight = (torch.randn(n, k, device="cuda") * 0.02).to(dtype)
    mask = torch.rand(n, k, device="cuda") >= sparsity
    dense = torch.where(mask, weight, torch.zeros((), dtype=dtype, device="cuda"))
    encoded = get_format("tiled-bitmap").encode(weight.cpu(), mask.cpu())
    tensors = {name: (t if name == "shape" else t.cuda()) for name, t in encoded.items()}
    return dense, tensors


def copies_for(nbytes: int) -> int:
    return max(2, min(256, math.ceil(ROTATION_BYTES / nbytes)))


def check(dense: torch.Tensor, tensors: dict, dtype: torch.dtype, label: str) -> None:
    from serving.kernels.tiled_bitmap_triton import tiled_bitmap_linear

    for m in (1, 16, 128):
        x = torch.randn(m, dense.shape[1], device="cuda").to(dtype)
        reference = x.float() @ dense.float().T
        got = tiled_bitmap_linear(x, tensors).float()
        scale = reference.abs().max().item() + 1e-6
        error = (got - reference).abs().max().item() / scale
        if not error < 2e-2:
            fail(f"{label} M={m}: sparse kernel disagrees with the dense reference (max error {error:.3g} "
                 f"of the largest output)")


def measure(m: int, dense: torch.Tensor, dense_copies: list, sparse_copies: list, sparse_bytes: int,
            peak: float) -> dict:
    """One row: dense cuBLAS, the dispatcher (`sparse_us`), expand-to-dense + cuBLAS (M >= 16) and,
    above the dispatcher's threshold, the sparse kernel forced (`kernel_us`), all on the same x."""
    from serving.kernels import tiled_bitmap_triton as kernels

    n, k = dense.shape
    x = torch.randn(m, k, device="cuda").to(dense.dtype)
    dense_us = time_per_call([partial(torch.matmul, x, w.T) for w in dense_copies])
    sparse_us = time_per_call([partial(kernels.tiled_bitmap_linear, x, t) for t in sparse_copies])
    fallback_us = None
    if m >= 16:
        fallback_us = time_per_call([lambda t=t: torch.matmul(x, kernels.tiled_bitmap_decode(t).T)
                                     for t in sparse_copies])
    kernel_us = sparse_us
    if m > kernels.SPARSE_KERNEL_MAX_M:
        forced = partial(kernels.tiled_bitmap_linear, block_m=128)
        kernel_us = time_per_call([partial(forced, x, t) for t in sparse_copies])
    io_bytes = (m * k + m * n) * dense.element_size()
    dense_bytes = dense.numel() * dense.element_size()
    return {"m": m, "dense_us": round(dense_us, 2), "sparse_us": round(sparse_us, 2),
            "speedup": round(dense_us / sparse_us, 3),
            "bandwidth_fraction": round((sparse_bytes + io_bytes) / (sparse_us * 1e-6) / peak, 3),
            "dense_bandwidth_fraction": round((dense_bytes + io_bytes) / (dense_us * 1e-6) / peak, 3),
            "fallback_us": None if fallback_us is None else round(fallback_us, 2),
            "kernel_us": round(kernel_us, 2),
            "sparse_bytes_per_weight": round(sparse_bytes / dense.numel(), 4)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--peak-tbps", type=float, default=None, help="peak HBM bandwidth, TB/s")
    parser.add_argument("--quick", action="store_true", help="one shape per model, 50%% only")
    parser.add_argument("--out", type=Path, default=RESULTS / "kernels")
    args = parser.parse_args(argv)
    require_cuda_and_triton("bench.kernels --format tiled-bitmap")
    from serving.kernels.tiled_bitmap_triton import tiled_bitmap_linear
    from sparse_formats import nbytes

    dtype = dtype_from_name(args.dtype)
    device = torch.cuda.get_device_name()
    peak = peak_tbps(device, args.peak_tbps) * 1e12
    shapes = [(model, shape) for model, group in SHAPES.items()
              for shape in (group[:1] if args.quick else group)]
    sparsities = SPARSITIES[:1] if args.quick else SPARSITIES
    torch.manual_seed(0)
    rows, sweep = [], []
    total = len(shapes) * len(sparsities)
    for index, ((model, (n, k)), sparsity) in enumerate(
            ((s, p) for s in shapes for p in sparsities), start=1):
        dense, tensors = make_weights(n, k, sparsity, dtype)
        label = f"{model} {n}x{k} {int(sparsity * 100)}%"
        check(dense, tensors, dtype, label)
        sparse_bytes = nbytes(tensors)
        copies = copies_for(sparse_bytes)
        dense_copies = [dense.clone() for _ in range(copies)]
        sparse_copies = [{name: (t if name == "shape" else t.clone()) for name, t in tensors.items()}
                         for _ in range(copies)]
        for m in TOKENS + (PREFILL_TOKENS if sparsity == 0.5 else []):
            rows.append(measure(m, dense, dense_copies, sparse_copies, sparse_bytes, peak) | {
                "device": device, "model": model, "shape": [n, k], "sparsity": sparsity, "dtype": args.dtype})
        if sparsity == 0.5:
            x = torch.randn(1, k, device="cuda").to(dtype)
            for split_k in (1, 2, 4, 8, 16, 32, 64):
                for num_warps in (2, 4, 8):
                    launch = partial(tiled_bitmap_linear, split_k=split_k, num_warps=num_warps)
                    us = time_per_call([partial(launch, x, t) for t in sparse_copies])
                    sweep.append({"shape": [n, k], "split_k": split_k, "num_warps": num_warps,
                                  "sparse_us": round(us, 2)})
        del dense_copies, sparse_copies
        torch.cuda.empty_cache()
        last = [r for r in rows if r["shape"] == [n, k] and r["sparsity"] == sparsity]
        print(f"[{index}/{total}] {label}: speed-up at M=1, 16, 128: "
              f"{last[0]['speedup']}, {last[4]['speedup']}, {last[7]['speedup']}", flush=True)
    write_results(rows, sweep, device, args.out)


def write_results(rows: list[dict], sweep: list[dict], device: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    device_slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-")
    stem = f"kernels_{device_slug}_{datetime.date.today().isoformat()}"
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    (out / f"{stem}_splits.json").write_text(json.dumps(sweep, indent=1))
    tokens = sorted({r["m"] for r in rows})
    print("speed-up over cuBLAS (fraction of peak bandwidth the sparse call reaches)")
    print(f"| shape | sparsity | {' | '.join(f'M={m}' for m in tokens)} |")
    print(f"|---|---|{'---|' * len(tokens)}")
    for shape in dict.fromkeys(tuple(r["shape"]) for r in rows):
        for sparsity in dict.fromkeys(r["sparsity"] for r in rows):
            cells = {r["m"]: r for r in rows if tuple(r["shape"]) == shape and r["sparsity"] == sparsity}
            print(f"| {shape[0]}x{shape[1]} | {int(sparsity * 100)}% | " + " | ".join(
                f"{cells[m]['speedup']:.2f}x ({cells[m]['bandwidth_fraction']:.0%})" if m in cells else "-"
                for m in tokens) + " |")
    print("large M at 50%: microseconds for dense cuBLAS / dispatcher / sparse kernel / expand + cuBLAS")
    for r in rows:
        if r["m"] >= 16 and r["sparsity"] == 0.5:
            print(f"  {r['shape'][0]}x{r['shape'][1]} M={r['m']}: {r['dense_us']} / {r['sparse_us']} / "
                  f"{r['kernel_us']} / {r['fallback_us']}")
    for shape in dict.fromkeys(tuple(r["shape"]) for r in sweep):
        best = min((r for r in sweep if tuple(r["shape"]) == shape), key=lambda r: r["sparse_us"])
        print(f"best M=1 launch for {shape[0]}x{shape[1]} at 50%: split_k={best['split_k']} "
              f"num_warps={best['num_warps']} {best['sparse_us']} us")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in rows))
    columns = min(4, len(shapes))
    fig, axes = plt.subplots(math.ceil(len(shapes) / columns), columns, figsize=(4 * columns, 3.4 * math.ceil(
        len(shapes) / columns)), squeeze=False, sharey=True)
    for ax, shape in zip(axes.flat, shapes, strict=False):
        for sparsity in dict.fromkeys(r["sparsity"] for r in rows):
            cells = [r for r in rows if tuple(r["shape"]) == shape and r["sparsity"] == sparsity]
            ax.plot([r["m"] for r in cells], [r["speedup"] for r in cells], marker="o",
                    label=f"{int(sparsity * 100)}% sparse")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(0.9, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{shape[0]}x{shape[1]}")
        ax.set_xlabel("tokens M")
    for ax in axes[:, 0]:
        ax.set_ylabel("speed-up over cuBLAS dense")
    axes.flat[0].legend()
    fig.suptitle(f"tiled-bitmap kernel vs cuBLAS, {device}, {rows[0]['dtype']}")
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)
    print(f"wrote {out / stem}.json, {stem}_splits.json, {stem}.png")


if __name__ == "__main__":
    main()
