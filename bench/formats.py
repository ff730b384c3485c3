"""Encode/decode throughput and bytes per weight of every registered sparse format.

Throughput is GB/s of dense weights (rows * cols * element size / seconds), best of `--repeats` runs, by
wall clock and by this process's CPU time (the latter is what a shared, busy machine distorts least),
measured side by side with a plain copy of the same matrix (`clone`) so that the ratio to memory speed
survives a busy machine too. The one-pass bitmap encoder (`np.packbits` + `np.extract` over the whole
matrix, what `bitmap` did before its block-wise encoder) runs in the same loop, so that the gain of
blocking is a ratio from one run; so does every encoder with one thread (`SPARSE_FORMATS_THREADS=1`), for
the gain of the thread pool. The load average is recorded before and after: on a shared machine
wall-clock throughput says as much about the neighbours as about the code.
Writes bench/results/formats/formats.json and formats.md.

    .venv/bin/python -m bench.formats [--rows 4096 --cols 14336 --repeats 3]
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from bench.harness import RESULTS as BENCH_RESULTS
from sparse_formats import get_format, lossless_formats, nbytes
from sparse_formats.checks import THREADS_ENV, encode_threads, raw_bits

RESULTS = BENCH_RESULTS / "formats"


def best_time(fn, repeats: int) -> tuple[float, float, object]:
    """(best wall seconds, best CPU seconds, last result)."""
    best_wall, best_cpu, out = float("inf"), float("inf"), None
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        best_wall = min(best_wall, time.perf_counter() - wall)
        best_cpu = min(best_cpu, time.process_time() - cpu)
    return best_wall, best_cpu, out


def one_pass_bitmap_encode(weight: torch.Tensor, mask: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """The bitmap and values of `bitmap`, compacted in one pass over the whole matrix (the reference)."""
    keep = mask.numpy()
    return np.packbits(keep, axis=1, bitorder="little"), np.extract(keep, raw_bits(weight))


def run(rows: int, cols: int, sparsities: list[float], repeats: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    dense_bytes = weight.numel() * weight.element_size()
    load_before = os.getloadavg()[0]
    copy_s, _, _ = best_time(weight.clone, repeats)
    rows_out, one_pass = [], []
    for sparsity in sparsities:
        mask = torch.rand(rows, cols, generator=gen) >= sparsity
        expected = torch.where(mask, weight, torch.zeros((), dtype=weight.dtype))
        for name in lossless_formats():
            fmt = get_format(name)
            try:
                encode_s, encode_cpu, tensors = best_time(lambda fmt=fmt, mask=mask: fmt.encode(weight, mask),
                                                          repeats)
            except ValueError as exc:
                rows_out.append({"format": name, "sparsity": sparsity, "skipped": str(exc)})
                continue
            with mock.patch.dict(os.environ, {THREADS_ENV: "1"}):
                serial_s, _, serial = best_time(lambda fmt=fmt, mask=mask: fmt.encode(weight, mask), repeats)
            if any(not torch.equal(serial[key].view(torch.uint8), tensors[key].view(torch.uint8))
                   for key in tensors):
                raise SystemExit(f"{name}: one-thread encoding differs from the threaded one at {sparsity}")
            if name == "bitmap":
                one_pass_s, one_pass_cpu, (bitmap, values) = best_time(
                    lambda mask=mask: one_pass_bitmap_encode(weight, mask), repeats)
                if not (np.array_equal(bitmap, tensors["bitmap"].numpy())
                        and np.array_equal(values, raw_bits(tensors["values"]))):
                    raise SystemExit(f"bitmap differs from the one-pass reference at sparsity {sparsity}")
                one_pass.append({"sparsity": sparsity, "encode_gb_s": dense_bytes / one_pass_s / 1e9,
                                 "encode_gb_cpu_s": dense_bytes / one_pass_cpu / 1e9,
                                 "blocked_vs_one_pass_wall": one_pass_s / encode_s,
                                 "blocked_vs_one_pass_cpu": one_pass_cpu / encode_cpu})
            decode_s, decode_cpu, decoded = best_time(lambda fmt=fmt, tensors=tensors: fmt.decode(tensors),
                                                      repeats)
            if not torch.equal(decoded.view(torch.int16), expected.view(torch.int16)):
                raise SystemExit(f"{name} does not round trip at sparsity {sparsity}")
            rows_out.append({
                "format": name,
                "sparsity": sparsity,
                "encode_gb_s": dense_bytes / encode_s / 1e9,
                "encode_one_thread_gb_s": dense_bytes / serial_s / 1e9,
                "threads_vs_one_thread": serial_s / encode_s,
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
        "one_pass_bitmap": one_pass,
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "cpus": os.cpu_count(),
        "encoder_threads": encode_threads(),
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
        "| format | sparsity | encode GB/s | encode GB/s, 1 thread | threads / 1 thread | decode GB/s "
        "| encode GB/CPU-s | decode GB/CPU-s | encode / copy | decode / copy | bytes/weight |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["results"]:
        if "skipped" in row:
            lines.append(f"| {row['format']} | {row['sparsity']:.0%} | skipped: {row['skipped']} "
                         f"| | | | | | | | |")
            continue
        lines.append(f"| {row['format']} | {row['sparsity']:.0%} | {row['encode_gb_s']:.3f} | "
                     f"{row['encode_one_thread_gb_s']:.3f} | {row['threads_vs_one_thread']:.2f} | "
                     f"{row['decode_gb_s']:.3f} | {row['encode_gb_cpu_s']:.3f} | "
                     f"{row['decode_gb_cpu_s']:.3f} | {row['encode_vs_copy']:.3f} | "
                     f"{row['decode_vs_copy']:.3f} | {row['bytes_per_weight']:.3f} |")
    lines += ["", f"Load average (1 min) {report['load_average_1min'][0]:.1f} before, "
              f"{report['load_average_1min'][1]:.1f} after, on {report['cpus']} CPUs; "
              f"{report['encoder_threads']} encoder threads.", "",
              "Block-wise `bitmap` encode against the one-pass reference (packbits + np.extract over the "
              "whole matrix), same run:", "",
              "| sparsity | one-pass GB/s | one-pass GB/CPU-s | blocked / one-pass (wall) "
              "| blocked / one-pass (CPU) |",
              "| --- | --- | --- | --- | --- |"]
    for row in report["one_pass_bitmap"]:
        lines.append(f"| {row['sparsity']:.0%} | {row['encode_gb_s']:.3f} | {row['encode_gb_cpu_s']:.3f} | "
                     f"{row['blocked_vs_one_pass_wall']:.2f} | {row['blocked_vs_one_pass_cpu']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=14336)
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.5, 0.6, 0.7])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    report = run(args.rows, args.cols, args.sparsities, args.repeats, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "formats.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (args.out / "formats.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
