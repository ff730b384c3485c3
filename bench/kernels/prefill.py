"""Prefill (M rows of x at once) of the bitmap-q4 ops against dense bf16 `F.linear`, per projection shape.

    taskset -c 0 python -m bench.kernels --format bitmap-q4 --phase prefill [--tokens 400]
        [--sparsities 0.5 0.6] [--group 64] [--repeats 9] [--shapes qkv o gate_up down lm_head] [--isa auto]
        [--model Llama-3.2-1B | SmolLM2-135M] [--ops dense onednn q4-i8 q4-i8t q4]

For each projection of one Llama-3.2-1B layer as vLLM merges them (qkv 3072x2048, o 2048x2048, gate_up
16384x2048, down 2048x8192; --model SmolLM2-135M: 960x576, 576x576, 3072x576, 576x1536) and the 4-bit dense
lm_head (Llama-3.2-1B: 49152x2048, SmolLM2-135M: 49152x576; the tied head, never pruned), with a
random weight masked exactly per row at each sparsity, it times side by side, taking turns call by call:
- dense: `torch.nn.functional.linear(x, W)` with x and the same (decoded) W in bf16;
- onednn: what stock vLLM runs for that dense layer on this CPU (`dispatch_cpu_unquantized_gemm`: oneDNN with
  the weight packed once, `vllm._custom_ops.create_onednn_mm` + `onednn_mm`), where vLLM's CPU ops import;
- q4-i8: `torch.ops.leap_sparse_cpu.bitmap_q4_i8_linear` on `Q4Weight.pairs()` (the served default: above 8
  rows of x its int8 prefill kernel), where the CPU has AVX-512 VNNI;
- q4-i8t: the same op with `bitmap_q4_i8_prefill("tiles")`: above 8 rows x as it is, exact decoded tiles and
  ATen's GEMM (the int8 op's prefill before the int8 kernel);
- q4: `torch.ops.leap_sparse_cpu.bitmap_q4_linear` on the stored bitmap-q4 tensors.
x is bf16 [tokens, in]. Prints medians (ms) and each op's ratio to dense, to onednn and to q4-i8t, per shape
and summed over the layer's four projections. Run it pinned to one core with torch at one thread (it sets 1
thread).
The lm_head row is for reference: in a vLLM prefill it multiplies only the rows that are sampled from.

Measured 2026-11-25 (2-core EPYC Zen 5, `taskset -c 0`, medians of 7, a second process busy on the other core;
runs of the two builds alternated), layer sums, ratio to dense F.linear / to vLLM's oneDNN linear:
- before (fp32 tiles converted by ATen, the product copied into y, 0.5M-weight tiles): q4-i8 1.061 / 1.111 at
  50%, q4 1.054 / 1.104 (per projection 1.04-1.08 / 1.10-1.11); at 60% 1.12 / 1.17 (a noisier run);
- after (bf16 tiles decoded directly, mm_out into y, 1M-weight tiles): q4-i8 0.990-0.991 / 1.023-1.026 at 50%,
  0.986-0.991 / 1.029-1.041 at 60%; q4 0.978-0.979 / 1.009-1.015 and 0.976-0.979 / 1.019-1.028 (per
  projection q4-i8 0.98-1.01 / 1.02-1.05, gate_up 16384x2048 57.6-59.5 ms against oneDNN 56.1-58.2).
vLLM's oneDNN linear (the weight packed once) runs 3.5-5% faster than F.linear (which reorders the whole
weight every call); the tiles' GEMMs alone match it, and the remaining 2-4% is the decode of the tiles.
(q4-i8 here ran the tiles, as q4-i8t does now.)
SmolLM2-135M after (medians of 15, one run): layer q4-i8 1.008-1.023 / 1.057-1.077, q4 1.006-1.009 /
1.054-1.063; its 576-column projections take 0.5-3 ms, where oneDNN's packed weight gains 5-6% over F.linear.
Then the int8 prefill kernel (`--repeats 9 --ops dense onednn q4-i8 q4-i8t`, same machine, one run, the
other core's load changing between the two sparsities), layer sums, q4-i8 to dense / onednn / q4-i8t: 50%
0.581 / 0.595 / 0.569 (121.9 ms against 214.1 for the tiles), 60% 0.574 / 0.608 / 0.586; lm_head 0.620 /
0.652 / 0.626. Again with the other core quiet, 50%: 0.565 / 0.589 / 0.572 (59.7 ms against 101.4 for
onednn). SmolLM2-135M (--repeats 15): 0.600 / 0.627 / 0.584. By M: docs/kernels.md.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bench.harness import onednn_ops
from serving import cpu_kernel
from serving.q4_linear import Q4Weight
from sparse_formats import get_format

MODELS = {  # model -> {projection: [n, k]}
    "Llama-3.2-1B": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                     "lm_head": (49152, 2048)},
    "SmolLM2-135M": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                     "lm_head": (49152, 576)},
}
SHAPES = MODELS["Llama-3.2-1B"]
LAYER = ("qkv", "o", "gate_up", "down")  # one decoder layer's projections
OPS = ("dense", "onednn", "q4-i8", "q4-i8t", "q4")


def weights(n: int, k: int, sparsity: float, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    mask = torch.rand(n, k, generator=gen).argsort(dim=1) >= round(k * sparsity)  # exact per row
    t = get_format("bitmap-q4").encode(weight, mask, group_size=group)
    q4 = Q4Weight.from_tensors("bitmap-q4", t)
    return t, q4, get_format("bitmap-q4").decode(t).to(torch.bfloat16)


def make_ops(x: torch.Tensor, t: dict, dense: torch.Tensor, pairs, onednn, wanted) -> dict:
    """The calls to time: dense F.linear, vLLM's oneDNN linear (where available), the int8-x op on the pair
    layout (where available), the q4 op."""
    ops = torch.ops.leap_sparse_cpu
    k = x.shape[-1]
    made = {"dense": lambda: F.linear(x, dense)}
    if onednn is not None:
        handler = onednn[0](dense.t(), 32)
        made["onednn"] = lambda: onednn[1](handler, x, None)
    if pairs is not None:
        def i8(mode: str):
            def run():
                ops.bitmap_q4_i8_prefill(mode)
                return ops.bitmap_q4_i8_linear(x, *pairs.tensors().values(), pairs.n_rows, k, None,
                                               checked=True)
            return run
        made["q4-i8"] = i8("int8")
        made["q4-i8t"] = i8("tiles")
    parts = (t["bitmap"], t["codes"], t["scales"], t["row_offsets"])
    made["q4"] = lambda: ops.bitmap_q4_linear(x, *parts, k, None, checked=True)
    return {name: run for name, run in made.items() if name in wanted}


def time_ops(ops: dict, repeats: int) -> dict[str, float]:
    for _ in range(3):  # warm-up: the first calls in a process run slower (oneDNN primitives, pages)
        for run in ops.values():
            run()
    samples = {name: [] for name in ops}
    for i in range(repeats):
        order = list(ops.items())
        order = order[i % len(order):] + order[:i % len(order)]
        for name, run in order:
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) * 1e3 for name, v in samples.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.5, 0.6])
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--model", default="Llama-3.2-1B", choices=list(MODELS))
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=list(OPS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    assert cpu_kernel.load(), cpu_kernel.unavailable_reason()
    i8 = cpu_kernel.int8_kernel_available()
    onednn = onednn_ops()
    print(f"M = {args.tokens} bf16 rows, group {args.group}, isa {cpu_kernel.current_isa()}, 1 thread; ms, "
          f"medians of {args.repeats}")
    for sparsity in args.sparsities:
        totals: dict[str, float] = {}
        print(f"\nsparsity {sparsity:.0%}" + "  (lm_head: every weight kept)" * ("lm_head" in args.shapes))
        print(f"{'shape':>8} {'n x k':>12} " + " ".join(header(op) for op in args.ops))
        for name in args.shapes:
            n, k = MODELS[args.model][name]
            t, q4, dense = weights(n, k, 0.0 if name == "lm_head" else sparsity, args.group, seed=n + k)
            pairs = q4.pairs() if i8 else None
            x = torch.randn(args.tokens, k).to(torch.bfloat16)
            ms = time_ops(make_ops(x, t, dense, pairs, onednn, args.ops), args.repeats)
            if name in LAYER:
                for op, v in ms.items():
                    totals[op] = totals.get(op, 0.0) + v
            print(row(name, f"{n}x{k}", ms, args.ops), flush=True)
        if totals:
            print(row("layer", "", totals, args.ops))


def header(op: str) -> str:
    """op's columns: its time, and for the sparse ops its ratios to dense, oneDNN and the int8 op's tiles."""
    return f"{op:>8}" + ("" if op in ("dense", "onednn") else f" {'/dense':>6} {'/onednn':>7} {'/i8t':>6}")


def row(name: str, shape: str, ms: dict[str, float], ops) -> str:
    nan = float("nan")
    cells = []
    for op in ops:
        v = ms.get(op, nan)
        cells.append(f"{v:8.2f}")
        if op not in ("dense", "onednn"):
            cells.append(" ".join(f"{v / ms.get(ref, nan):{width}.3f}"
                                  for ref, width in (("dense", 6), ("onednn", 7), ("q4-i8t", 6))))
    return f"{name:>8} {shape:>12} " + " ".join(cells)


if __name__ == "__main__":
    main()
