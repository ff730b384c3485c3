"""Encode/decode throughput and bytes per weight of every registered sparse format.

Throughput is GB/s of dense weights (rows * cols * element size / seconds), best of `--repeats` runs, by
wall clock and by this process's CPU time (the latter is what a shared, busy machine distorts least),
measured side by side with a plain copy of the same matrix (`clone`) so that the ratio to memory speed
survives a busy machine too. Writes bench/results/formats.json and formats.md.

    .venv/bin/python bench/formats.py [--rows 4096 --cols 14336 --repeats 3]
"""

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from sparse_formats import FORMATS, get_format, nbytes

RESULTS = Path(__file__).parent / "results"


def best_time(fn, repeats: int) -> tuple[float, float, object]:
    """(best wall seconds, best CPU seconds, last result)."""
    best_wall, best_cpu, out = float("inf"), float("inf"), None
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return best_wall, best_cpu, out


def run(rows: int, cols: int, sparsities: list[float], repeats: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    dense_bytes = weight.numel() * weight.element_size()
    copy_s, _, _ = best_time(weight.clone, repeats)
    rows_out = []
    for sparsity in sparsities:
        mask = torch.rand(rows, cols, generator=gen) >= sparsity
        expected = torch.where(mask, weight, torch.zeros((), dtype=weight.dtype))
        for name in sorted(FORMATS):
            fmt = get_format(name)
            try:
                encode_s, encode_cpu, tensors = best_time(lambda fmt=fmt, mask=mask: fmt.encode(weight, mask),
                                                          repeats)
            except ValueError as exc:
                rows_out.append({"format": name, "sparsity": sparsity, "skipped": str(exc)})
                continue
            decode_s, decode_cpu, decoded = best_time(lambda fmt=fmt, tensors=tensors: fmt.decode(tensors),
                                                      repeats)
            if not torch.equal(decoded.view(torch.int16), expected.view(torch.int16)):
                raise SystemExit(f"{name} does not round trip at sparsity {sparsity}")
            rows_out.append({
                "format": name,
                "sparsity": sparsity,
                "encode_gb_s": dense_bytes / encode_s / 1e9,
                "decode_gb_s": dense_bytes / decode_s / 1e9,
                "encode_gb_cpu_s": dense_bytes / encode_cpu / 1e9,
                "decode_gb_cpu_s": dense_bytes / decode_cpu / 1e9,
                "encode_vs_copy": copy_s / encode_s,
                "decode_vs_copy": copy_s / decode_s,
                "bytes_per_weight": nbytes(tensors) / weight.numel(),
            })
    return {
        "matrix": [rows, cols],
        "dtype": "bfloat16",
        "repeats": repeats,
        "copy_gb_s": dense_bytes / copy_s / 1e9,
        "results": rows_out,
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "processor": platform.processor() or platform.machine()},
    }


def markdown(report: dict) -> str:
    rows, cols = report["matrix"]
    lines = [
        f"Sparse formats on a {rows}x{cols} bf16 matrix (dense bf16 = 2 bytes/weight); "
        f"plain copy {report['copy_gb_s']:.2f} GB/s in the same run.",
        "",
        "| format | sparsity | encode GB/s | decode GB/s | encode GB/CPU-s | decode GB/CPU-s | encode / copy "
        "| decode / copy | bytes/weight |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["results"]:
        if "skipped" in row:
            lines.append(f"| {row['format']} | {row['sparsity']:.0%} | skipped: {row['skipped']} "
                         f"| | | | | | |")
            continue
        lines.append(f"| {row['format']} | {row['sparsity']:.0%} | {row['encode_gb_s']:.3f} | "
                     f"{row['decode_gb_s']:.3f} | {row['encode_gb_cpu_s']:.3f} | "
                     f"{row['decode_gb_cpu_s']:.3f} | {row['encode_vs_copy']:.3f} | "
                     f"{row['decode_vs_copy']:.3f} | {row['bytes_per_weight']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=14336)
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.5, 0.6, 0.7])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    report = run(args.rows, args.cols, args.sparsities, args.repeats, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "formats.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (args.out / "formats.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
