"""The native CPU op on the bitmap-q4 layout against the bf16 bitmap op and dense bf16, per layer shape.

    python -m bench.kernels --format bitmap-q4 --phase decode [--models SmolLM2-135M Llama-3.2-1B]
        [--sparsities 0.5 0.6] [--tokens 1 4 8 16] [--groups 64] [--extra-groups 32 128] [--threads 1]
        [--grid asymmetric|symmetric] [--repeats 11] [--rotate-mib 256]
        [--out bench/results/kernels/cpu_kernels_q4]

For every decoder linear shape of each model ([n, k] = [out, in] features, each projection on its own:
q/o, k/v, gate/up, down), each sparsity, group size and M rows of x (bf16), it times on one masked weight:
- q4: `torch.ops.leap_sparse_cpu.bitmap_q4_linear` on the `bitmap-q4` encoding (codes + fp16 scales);
- q4-int8: `torch.ops.leap_sparse_cpu.bitmap_q4_i8_linear` (int8 x, what `leapctl serve` runs by default) on
  the pair layout `Q4Weight.pairs()` makes on this CPU (AVX2 and the asymmetric grid: the dense layout, each
  pruned column its zero point; else masks and kept codes), and q4-int8-other on the other one where the
  grid has both (its result is checked against the same tolerance: it rounds x to int8);
- bitmap: `torch.ops.leap_sparse_cpu.bitmap_linear` on the `bitmap` encoding with bf16 values;
- `torch.nn.functional.linear` on the dense masked weight in bf16, and vLLM's oneDNN linear where vLLM's CPU
  ops import (as `bench/kernels/bitmap.py` sets it up).
Decode reads every weight from DRAM, so each op cycles through copies of its own weight that together hold
at least --rotate-mib MiB (8x the 32 MiB L3 by default; the q4 copies are 5x smaller than the dense ones,
so each op gets its own copy count); the ops take turns repetition by repetition so that load from other
processes hits them alike; figures are medians per call. Weights are random, masks exactly the same density
in every row (as Wanda's are).

Read bandwidth: `torch.sum` over a 1 GiB fp32 tensor with one thread (and each --threads count), medians of
7, measured in the same run. weight GB/s = bytes of bitmap + codes + scales (+ row offsets) per q4 call
/ time; fraction = that / the read bandwidth.

Writes OUT.json (rows and settings) and OUT.md (tables).
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

from bench.harness import RESULTS, device_name, onednn_ops, read_bandwidth, write_results
from leapctl.grid import round_to_grid, search_asymmetric
from leapctl.quantize.config import ASYMMETRIC, SYMMETRIC
from serving import cpu_kernel
from serving.q4_linear import pruned_at_zero_by_default
from sparse_formats import get_format

LAYERS = {  # model -> {projection: [n, k]}
    "SmolLM2-135M": {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576), "down": (576, 1536)},
    "Llama-3.2-1B": {"q/o": (2048, 2048), "k/v": (512, 2048), "gate/up": (8192, 2048), "down": (2048, 8192)},
}
READ_BYTES = 1 << 30


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def random_q4(n: int, k: int, sparsity: float, group: int, seed: int, grid: str):
    """A random [n, k] weight, exactly `sparsity` of every row pruned (as Wanda's masks are), encoded as
    bitmap-q4 on `grid` in groups of `group` columns: (the format's tensors, the mask)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    mask = torch.rand(n, k, generator=gen).argsort(dim=1) >= round(k * sparsity)  # exact per row
    fmt = get_format("bitmap-q4")
    if grid == ASYMMETRIC:
        scales, zeros = search_asymmetric(weight, mask, group)
        return fmt.encode(round_to_grid(weight, scales, zeros), mask, scales=scales, zeros=zeros), mask
    return fmt.encode(weight, mask, group_size=group), mask


def make_weights(n: int, k: int, sparsity: float, group: int, rotate: int, seed: int, grid: str):
    """Copies (separate memory, equal contents) of the dense bf16 weight, its bitmap encoding, its bitmap-q4
    encoding on `grid` (bitmap, codes, scales, row offsets, zero points or None) and the int8 op's pair
    layouts ({"q4-int8": the one `Q4Weight.pairs()` picks on this CPU, "q4-int8-other": the asymmetric
    grid's other one}) with the served one's name (dense: every column a code, pruned ones at their zero
    point; sparse: the kept ones' codes and masks), each op's copies holding at least `rotate` bytes."""
    q4, mask = random_q4(n, k, sparsity, group, seed, grid)
    fmt = get_format("bitmap-q4")
    zeros = q4.get("zeros")  # as stored: two 4-bit zero points a byte
    q4_parts = (q4["bitmap"], q4["codes"], q4["scales"], q4["row_offsets"], zeros)
    dense = fmt.decode(q4).to(torch.bfloat16)  # the same weights for every op
    bitmap = get_format("bitmap").encode(dense, mask)
    bitmap_parts = (bitmap["bitmap"], bitmap["values"], bitmap["row_offsets"])

    def copies(parts):
        count = max(2, math.ceil(rotate / nbytes(parts)))
        return [tuple(None if t is None else t.clone() for t in parts) for _ in range(count)]

    pairs, served_at_zero = {}, pruned_at_zero_by_default(zeros is not None)
    if group % 64 == 0 and cpu_kernel.int8_kernel_available():  # the int8 op needs 64-column groups
        layouts = {"q4-int8": served_at_zero}
        if zeros is not None:
            layouts["q4-int8-other"] = not served_at_zero
        for name, at_zero in layouts.items():
            made = torch.ops.leap_sparse_cpu.bitmap_q4_pack_pairs(*q4_parts[:4], k, zeros, at_zero)
            pairs[name] = copies(tuple(made))
    served = "dense" if served_at_zero else "sparse"
    return copies((dense,)), copies(bitmap_parts), copies(q4_parts), pairs, served


def time_ops(ops: dict, repeats: int) -> dict[str, float]:
    """Median microseconds per call of each op: (callable running every copy once, copy count)."""
    for run, _ in ops.values():  # warm-up: page in the copies, build oneDNN primitives
        run()
    samples = {name: [] for name in ops}
    for i in range(repeats):
        order = list(ops.items())
        order = order[i % len(order) :] + order[: i % len(order)]  # rotate who runs first
        for name, (run, copies) in order:
            start = time.perf_counter()
            run()
            samples[name].append((time.perf_counter() - start) / copies * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


def print_row(r: dict, us: dict[str, float]) -> None:
    """One M's timings as they come."""
    int8 = (
        f", q4-int8 {us['q4-int8']:8.1f} us ({r['int8_layout']}; {r['int8_weight_gbs']:5.1f} GB/s, "
        f"{r['int8_bandwidth_fraction']:.2f})"
        if "q4-int8" in us
        else ""
    )
    if "q4-int8-other" in us:
        int8 += f", the other layout {us['q4-int8-other']:8.1f} us"
    print(
        f"    {r['threads']} thr M={r['m']:2d}{int8}: q4 {us['q4']:8.1f} us ({r['weight_gbs']:5.1f} GB/s, "
        f"{r['bandwidth_fraction']:.2f}), bitmap {us['bitmap']:8.1f}, dense {r['dense_us']:8.1f} "
        f"({r['dense_op']}): x{r['q4_over_bitmap']:.2f} over bitmap, x{r['q4_over_dense']:.2f} over dense",
        flush=True,
    )


def measure_layer(args, onednn, bandwidth, model, layer, n, k, sparsity, group, tokens) -> list[dict]:
    dense, bitmap, q4, pairs, int8_layout = make_weights(
        n, k, sparsity, group, args.rotate_mib << 20, seed=n * 31 + k, grid=args.grid
    )
    i8_op = torch.ops.leap_sparse_cpu.bitmap_q4_i8_linear
    handlers = [onednn[0](w.t(), 32) for (w,) in dense] if onednn else []
    q4_bytes = nbytes(q4[0])
    q4_op, bitmap_op = torch.ops.leap_sparse_cpu.bitmap_q4_linear, torch.ops.leap_sparse_cpu.bitmap_linear

    def q4_call(x, w):
        return q4_op(x, *w[:4], k, None, w[4], checked=True)  # the layout made here: timed unchecked

    def i8_call(x, w):
        return i8_op(x, *w[:4], n, k, None, w[4], checked=True)

    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for m in tokens:
            x = torch.randn(m, k).to(torch.bfloat16)
            ref = F.linear(x.float(), dense[0][0].float())
            results = [q4_call(x, q4[0]), bitmap_op(x, *bitmap[0], k, None)]
            results += [i8_call(x, layout[0]) for layout in pairs.values()]
            for got in results:
                assert torch.allclose(got.float(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item()), (
                    f"an op disagrees with dense for {model} {layer} M={m}"
                )
            ops = {
                "q4": (lambda x=x: [q4_call(x, w) for w in q4], len(q4)),
                "bitmap": (lambda x=x: [bitmap_op(x, *w, k, None) for w in bitmap], len(bitmap)),
                "linear": (lambda x=x: [F.linear(x, w) for (w,) in dense], len(dense)),
            }
            if handlers:
                ops["onednn"] = (lambda x=x: [onednn[1](h, x, None) for h in handlers], len(handlers))
            for name, weights in pairs.items():
                ops[name] = (lambda x=x, ws=weights: [i8_call(x, w) for w in ws], len(weights))
            us = time_ops(ops, args.repeats)
            dense_op = min((name for name in us if name in ("linear", "onednn")), key=us.get)
            weight_gbs = q4_bytes / (us["q4"] * 1e-6) / 1e9
            # the int8 op streams the pair layout (a few % larger than the stored codes): its own bytes
            int8_gbs = nbytes(pairs["q4-int8"][0]) / (us["q4-int8"] * 1e-6) / 1e9 if "q4-int8" in us else None
            rows.append(
                {
                    "model": model,
                    "layer": layer,
                    "shape": [n, k],
                    "m": m,
                    "sparsity": sparsity,
                    "group": group,
                    "threads": threads,
                    "q4_us": round(us["q4"], 2),
                    "q4_int8_us": round(us["q4-int8"], 2) if "q4-int8" in us else None,
                    "bitmap_us": round(us["bitmap"], 2),
                    "linear_us": round(us["linear"], 2),
                    "onednn_us": round(us["onednn"], 2) if "onednn" in us else None,
                    "dense_op": dense_op,
                    "dense_us": round(us[dense_op], 2),
                    "q4_bytes": q4_bytes,
                    "bitmap_bytes": nbytes(bitmap[0]),
                    "dense_bytes": nbytes(dense[0]),
                    "q4_over_bitmap": round(us["bitmap"] / us["q4"], 3),
                    "q4_over_dense": round(us[dense_op] / us["q4"], 3),
                    "weight_gbs": round(weight_gbs, 2),
                    "bandwidth_fraction": round(weight_gbs * 1e9 / bandwidth[threads], 3),
                    "int8_weight_gbs": None if int8_gbs is None else round(int8_gbs, 2),
                    "int8_bandwidth_fraction": None
                    if int8_gbs is None
                    else round(int8_gbs * 1e9 / bandwidth[threads], 3),
                    "int8_layout": int8_layout if pairs else None,
                    "int8_bytes": nbytes(pairs["q4-int8"][0]) if pairs else None,
                    "q4_int8_other_us": round(us["q4-int8-other"], 2) if "q4-int8-other" in us else None,
                    "int8_other_bytes": nbytes(pairs["q4-int8-other"][0])
                    if "q4-int8-other" in pairs
                    else None,
                }
            )
            print_row(rows[-1], us)
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = markdown_header(meta)
    for threads in sorted({r["threads"] for r in rows}):
        subset = [r for r in rows if r["threads"] == threads]
        tokens = sorted({r["m"] for r in subset})
        lines += markdown_table(subset, threads, tokens)
        lines.append("")
        lines += geometric_means(subset, tokens, meta["group"])
        lines.append("")
    return "\n".join(lines)


def markdown_header(meta: dict) -> list[str]:
    """What was measured, on what, and how busy the machine was."""
    bw = ", ".join(
        f"{t} thread{'s' if int(t) > 1 else ''} {b / 1e9:.1f} GB/s" for t, b in meta["read_bandwidth"].items()
    )
    return [
        f"bitmap-q4 op ({meta['grid']} grid) against the bf16 bitmap op and dense bf16 (the faster of "
        f"F.linear and vLLM's oneDNN linear{'' if meta['onednn'] else ', not importable: F.linear only'}), "
        f"x in bf16; q4-int8: the int8-x op ({meta['isa']} kernels) on the pair layout serving picks here, "
        f"{meta['device']}, "
        f"{meta['date']}.",
        "",
        f"Median time per call over {meta['repeats']} repetitions, each op cycling through copies of its "
        f"weight holding at least {meta['rotate_mib']} MiB (DRAM, not the 32 MiB L3). Load average (1 min) "
        f"{meta['load_before']:.2f} before, {meta['load_after']:.2f} after, on {os.cpu_count()} CPUs "
        f"(other engineers' tests share the machine). Read bandwidth (torch.sum over 1 GiB): {bw}.",
        "",
        "weight GB/s: bytes of bitmap + codes + scales + row offsets per q4 call / its time; fraction: "
        "that / the read bandwidth with the same thread count. q4-int8 GB/s: the bytes of the pair layout "
        "it streams (masks, codes with their pass headers, scales) / its time.",
        "",
    ]


def markdown_table(subset: list[dict], threads: int, tokens: list[int]) -> list[str]:
    """One thread count's table: a line per layer, sparsity and group, a cell per M."""
    lines = [
        f"### {threads} thread{'s' if threads > 1 else ''}: time per call (us), q4-int8 / q4 / bitmap bf16 / "
        "dense bf16, and q4's weight read rate at M=1",
        "",
        "| model | layer | [n, k] | sparsity | G | q4 B/weight | "
        + " | ".join(f"M={m} q4-int8 / q4 / bitmap / dense" for m in tokens)
        + " | q4 over bitmap, M=1 | q4 over dense, M=1 | weight GB/s, M=1 | fraction, M=1 "
        "| q4-int8 GB/s, M=1 | q4-int8 fraction, M=1 |",
        "| --- | --- | --- | --- | --- | --- |" + " --- |" * len(tokens) + " --- |" * 6,
    ]
    keys = []
    for r in subset:
        key = (r["model"], r["layer"], tuple(r["shape"]), r["sparsity"], r["group"])
        if key not in keys:
            keys.append(key)
    for key in keys:
        by_m = {
            r["m"]: r
            for r in subset
            if (r["model"], r["layer"], tuple(r["shape"]), r["sparsity"], r["group"]) == key
        }
        first = by_m.get(1)
        model, layer, shape, sparsity, group = key
        any_r = next(iter(by_m.values()))
        cells = [
            f"{by_m[m]['q4_int8_us'] or float('nan'):.1f} / {by_m[m]['q4_us']:.1f} / "
            f"{by_m[m]['bitmap_us']:.1f} / {by_m[m]['dense_us']:.1f}"
            if m in by_m
            else ""
            for m in tokens
        ]
        tail = (
            (
                f"{first['q4_over_bitmap']:.2f} | {first['q4_over_dense']:.2f} | "
                f"{first['weight_gbs']:.1f} | "
                f"{first['bandwidth_fraction']:.2f} | "
                + (
                    f"{first['int8_weight_gbs']:.1f} | {first['int8_bandwidth_fraction']:.2f}"
                    if first.get("int8_weight_gbs")
                    else " | "
                )
            )
            if first
            else " | | | | | "
        )
        lines.append(
            f"| {model} | {layer} | {list(shape)} | {sparsity:.0%} | {group} | "
            f"{any_r['q4_bytes'] / (shape[0] * shape[1]):.3f} | " + " | ".join(cells) + f" | {tail} |"
        )
    return lines


def geometric_means(subset: list[dict], tokens: list[int], group: int) -> list[str]:
    """A line per sparsity: q4's geometric mean speed over the layers at group size `group`, per M."""
    lines = []
    for sparsity in sorted({r["sparsity"] for r in subset}):
        main = [r for r in subset if r["sparsity"] == sparsity and r["group"] == group]
        if not main:
            continue
        geo = {
            m: (
                math.exp(statistics.fmean(math.log(r["q4_over_bitmap"]) for r in main if r["m"] == m)),
                math.exp(statistics.fmean(math.log(r["q4_over_dense"]) for r in main if r["m"] == m)),
            )
            for m in tokens
            if any(r["m"] == m for r in main)
        }
        int8 = {
            m: math.exp(statistics.fmean(math.log(r["q4_us"] / r["q4_int8_us"]) for r in main if r["m"] == m))
            for m in geo
            if all(r["q4_int8_us"] for r in main if r["m"] == m)
        }
        lines.append(
            f"Geometric means over the layers, {sparsity:.0%}, G={group}: "
            + "; ".join(f"M={m} q4 {b:.2f}x bitmap, {d:.2f}x dense" for m, (b, d) in geo.items())
            + "."
            + (
                " q4-int8 over q4: " + "; ".join(f"M={m} {v:.2f}x" for m, v in int8.items()) + "."
                if int8
                else ""
            )
            + layout_line(main, geo)
        )
    return lines


def layout_line(rows: list[dict], tokens) -> str:
    """The int8 op on its served pair layout against the other one (the asymmetric grid's dense layout, each
    pruned column its zero point, or the sparse one), geometric mean per M."""
    ratios = {
        m: [r["q4_int8_other_us"] / r["q4_int8_us"] for r in rows if r["m"] == m and r["q4_int8_other_us"]]
        for m in tokens
    }
    if not any(ratios.values()):
        return ""
    layout = rows[0]["int8_layout"]
    other = "sparse" if layout == "dense" else "dense"
    return (
        f" q4-int8 on its {layout} pair layout over the {other} one: "
        + "; ".join(
            f"M={m} {math.exp(statistics.fmean(map(math.log, v))):.2f}x" for m, v in ratios.items() if v
        )
        + "."
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    parser.add_argument("--layers", nargs="+", default=None, help="only these projections (e.g. q/o down)")
    parser.add_argument("--sparsities", nargs="+", type=float, default=[0.5, 0.6])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 8, 16])
    parser.add_argument("--groups", type=int, default=64, help="group size of the main runs")
    parser.add_argument(
        "--extra-groups",
        nargs="*",
        type=int,
        default=[32, 128],
        help="other group sizes, timed once (Llama-3.2-1B down, 50%%, M=1)",
    )
    parser.add_argument(
        "--grid",
        choices=[ASYMMETRIC, SYMMETRIC],
        default=ASYMMETRIC,
        help="the 4-bit grid (quantize's default: asymmetric, a zero point per group)",
    )
    parser.add_argument("--threads", nargs="+", type=int, default=[1])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--rotate-mib", type=int, default=256)
    parser.add_argument("--out", default=str(RESULTS / "kernels" / "cpu_kernels_q4"))
    args = parser.parse_args(argv)
    if not cpu_kernel.load(verbose=True):
        sys.exit(f"the native kernel is unavailable: {cpu_kernel.unavailable_reason()}")
    onednn = onednn_ops()
    if onednn is None:
        print("note: vLLM's oneDNN ops are not importable; the dense baseline is F.linear only")
    load_before = os.getloadavg()[0]
    bandwidth = {t: read_bandwidth(t, READ_BYTES, warm_up=True) for t in sorted({1, *args.threads})}
    print(
        "read bandwidth: " + ", ".join(f"{t} thr {b / 1e9:.1f} GB/s" for t, b in bandwidth.items()),
        flush=True,
    )
    rows = []
    for model in args.models:
        for layer, (n, k) in LAYERS[model].items():
            if args.layers and layer not in args.layers:
                continue
            for sparsity in args.sparsities:
                print(f"{model} {layer} [{n}, {k}] {sparsity:.0%} G={args.groups}", flush=True)
                rows += measure_layer(
                    args, onednn, bandwidth, model, layer, n, k, sparsity, args.groups, args.tokens
                )
    for group in args.extra_groups:
        model, layer = "Llama-3.2-1B", "down"
        n, k = LAYERS[model][layer]
        print(f"{model} {layer} [{n}, {k}] 50% G={group}", flush=True)
        rows += measure_layer(args, onednn, bandwidth, model, layer, n, k, 0.5, group, [1])
    meta = {
        "device": device_name(),
        "repeats": args.repeats,
        "rotate_mib": args.rotate_mib,
        "group": args.groups,
        "grid": args.grid,
        "isa": cpu_kernel.current_isa(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "torch": torch.__version__,
        "onednn": onednn is not None,
        "read_bandwidth": {str(t): b for t, b in bandwidth.items()},
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    write_results(Path(args.out), meta, rows, markdown(rows, meta))


if __name__ == "__main__":
    main()
