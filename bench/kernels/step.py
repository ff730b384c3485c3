"""The sparse linears of one decode step, as vLLM runs them, without vLLM: every layer of a bitmap-q4 export
once in model order (cold: a step streams all the weights, 470 MB for the Llama-3.2-1B shape at 50%, far more
than the 32 MB L3) against each projection repeated in place (hot: what a per-layer micro-benchmark times).

    taskset -c 1 python -m bench.kernels --format bitmap-q4 --phase step EXPORT [--threads 1] [--sweeps 12]
        [--pages both|huge|small] [--activations bf16 int8] [--probe]

The layers are built as `leap_sparse` builds them (q/k/v and gate/up stacked, `Q4Weight.to`), each call is
`torch.ops.leap_sparse_cpu.bitmap_q4_linear` (`--activations bf16`) or, on the pair layout,
`bitmap_q4_i8_linear` (`int8`, the served default) with one bf16 row of x. `--pages both` holds the weights
twice, on 4 KiB pages and on huge pages (`serving.huge_pages`, what the served layers use); every arm
(pages x activations) is held separately and the arms' sweeps interleave. Prints ms per step: the cold sweep
(median), its split by projection, and the hot estimate. `--probe` times a torch.sum over as many bytes as the
arm's layers hold just before each of its sweeps and prints the read rates and their ratio, sweep by sweep:
the issue's "reads weights at >= 80% of the bandwidth the bench measures", measured seconds apart.

Measured 2026-11-25 (AMD EPYC, 1 thread on core 1, the other core busy with other jobs), llama-1b-shape
mag50 q4 head4: cold 32.3 ms on 4 KiB pages, 31.1 on huge pages (lm_head 3.1 of it); hot 25.1. Inside vLLM
(one process, compiled) the same layers took 34.4 ms of a 39.3 ms step under torch's profiler, and the
same sweep run there 35.4 ms on 4 KiB pages against 32.8 on huge pages: the page cost is larger in the
server than here."""

import argparse
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from serving import cpu_kernel
from serving.huge_pages import huge_page_copy
from serving.q4_linear import Q4Weight

STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
ORDER = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def load_layers(export: Path) -> list[tuple[str, Q4Weight]]:
    """(projection kind, weight) in the order a decode step calls them; lm_head last if it is 4-bit."""
    tensors = load_file(str(export / "model.safetensors"))

    def weight(prefix: str) -> Q4Weight:
        parts = {name: tensors[f"{prefix}.{name}"] for name in ("shape", "bitmap", "codes", "scales",
                                                               "row_offsets", "zeros")
                 if f"{prefix}.{name}" in tensors}  # zeros: the asymmetric grid's
        return Q4Weight.from_tensors("bitmap-q4", parts)

    layers, index = [], 0
    while f"model.layers.{index}.mlp.down_proj.codes" in tensors:
        for block, kind in ORDER:
            prefix = f"model.layers.{index}.{block}"
            shards = [weight(f"{prefix}.{name}") for name in STACKED.get(kind, (kind,))]
            layers.append((kind, Q4Weight.cat_rows(shards).to(torch.device("cpu"))))
        index += 1
    if "lm_head.codes" in tensors:
        layers.append(("lm_head", weight("lm_head").to(torch.device("cpu"))))
    return layers


def call(weight: Q4Weight, huge: bool, activations: str):
    """(multiply(x) for one layer, its tensors held on huge or 4 KiB pages; the bytes those tensors hold)."""
    place = huge_page_copy if huge else torch.clone
    if activations == "int8":
        pairs = weight.pairs()
        named = {name: place(t) for name, t in pairs.tensors().items()}
        zeros = named.pop("zeros", None)  # the asymmetric grid's
        op = torch.ops.leap_sparse_cpu.bitmap_q4_i8_linear
        def call(x):
            return op(x, *named.values(), pairs.n_rows, pairs.n_cols, None, zeros, checked=True)
        return call, pairs.nbytes()
    parts = tuple(place(t) for t in (weight.bitmap, weight.codes, weight.scales, weight.row_offsets))
    zeros = None if weight.zeros is None else place(weight.zeros)
    nbytes = sum(t.numel() * t.element_size() for t in parts + (() if zeros is None else (zeros,)))
    op = torch.ops.leap_sparse_cpu.bitmap_q4_linear
    return (lambda x: op(x, *parts, weight.n_cols, None, zeros, checked=True)), nbytes


def read_probe(nbytes: int, huge: bool):
    """A plain read of `nbytes` from DRAM, timed as a sweep is: torch.sum over an fp32 buffer on the same kind
    of pages. Its time next to each sweep's is what the kernel's read rate is measured against: on a shared
    host the memory bandwidth one core gets moves by a third within minutes (this bench's cold sweep of the
    1B shape gave 33.5 to 46.6 ms in four runs back to back), so rates taken minutes apart do not divide."""
    buffer = torch.ones(nbytes // 4)
    if huge:
        buffer = huge_page_copy(buffer)
    return lambda: buffer.sum()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sweeps", type=int, default=12)
    parser.add_argument("--pages", choices=("both", "huge", "small"), default="both")
    parser.add_argument("--activations", nargs="+", choices=("bf16", "int8"), default=["bf16"])
    parser.add_argument("--probe", action="store_true",
                        help="time a torch.sum over as many bytes before every sweep: the read rate's ratio")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_kernel.load():
        raise SystemExit(f"native kernel unavailable: {cpu_kernel.unavailable_reason()}")
    layers = load_layers(args.export)
    pages = [p for p in ("small", "huge") if args.pages in ("both", p)]
    held, step_bytes = {}, {}
    for p in pages:
        for a in args.activations:
            arm = f"{p} pages, {a} x"
            calls = [(kind, *call(w, p == "huge", a), w.n_cols) for kind, w in layers]
            held[arm] = [(kind, multiply, n_cols) for kind, multiply, _, n_cols in calls]
            step_bytes[arm] = sum(nbytes for _, _, nbytes, _ in calls)
    probes = {arm: read_probe(step_bytes[arm], arm.startswith("huge")) for arm in held} if args.probe else {}
    x = {n: torch.randn(1, n, dtype=torch.bfloat16) for n in {w.n_cols for _, w in layers}}
    sweeps = {arm: [] for arm in held}
    probe_times = {arm: [] for arm in probes}
    per_kind = {arm: {} for arm in held}
    for i in range(args.sweeps + 2):
        for arm, weights in held.items():
            if arm in probes:
                start = time.perf_counter()
                probes[arm]()
                if i >= 2:
                    probe_times[arm].append(time.perf_counter() - start)
            start = time.perf_counter()
            for kind, multiply, n_cols in weights:
                begin = time.perf_counter()
                multiply(x[n_cols])
                if i >= 2:
                    per_kind[arm].setdefault(kind, []).append(time.perf_counter() - begin)
            if i >= 2:  # the first two page the weights in
                sweeps[arm].append(time.perf_counter() - start)
    for arm, times in sweeps.items():
        split = ", ".join(f"{kind} {sum(v) / args.sweeps * 1e3:.2f}" for kind, v in per_kind[arm].items())
        print(f"cold sweep, {arm}: {statistics.median(times) * 1e3:.2f} ms per step ({split})")
        gigabytes = step_bytes[arm] / 1e9
        if arm in probe_times:  # each sweep against the read just before it
            ratios = sorted(p / t for p, t in zip(probe_times[arm], times, strict=True))
            rate, read = gigabytes / statistics.median(times), gigabytes / statistics.median(probe_times[arm])
            print(f"  read rate: {rate:.1f} GB/s for {gigabytes * 1e3:.0f} MB, torch.sum {read:.1f} GB/s; "
                  f"per sweep {statistics.median(ratios):.2f} of the read before it "
                  f"({ratios[0]:.2f} - {ratios[-1]:.2f})")
    for arm, weights in held.items():
        hot = 0.0
        for kind in dict.fromkeys(k for k, _, _ in weights):
            count = sum(1 for k, _, _ in weights if k == kind)
            _, multiply, n_cols = next(entry for entry in weights if entry[0] == kind)
            for _ in range(3):
                multiply(x[n_cols])
            samples = []
            for _ in range(20):
                begin = time.perf_counter()
                multiply(x[n_cols])
                samples.append(time.perf_counter() - begin)
            hot += statistics.median(samples) * count
        print(f"hot, {arm} (each projection repeated in place, x layer count): {hot * 1e3:.2f} ms per step")


if __name__ == "__main__":
    main()
