"""What serving's int8 activations (`leapctl serve --activations int8`, the default) cost in perplexity: a run
folder scored as it is and with every linear's input rounded per token as the int8 op rounds a decoding
step (`serving.q4_linear.int8_activations`, per group of the weight's 64 columns), side by side.

    python -m bench.quality int8 RUN [RUN ...] --ppl TEXT_FILE [--ppl ...] [--seq-len 1024] [--windows 0]
        [--group-size 64] [--out bench/results/quality/quality_int8]

Every token's row of x is rounded on its own scale, so scoring whole windows with the rounding on every
position gives what token-by-token decoding would see. lm_head's input is rounded as serving rounds it: per
group in 4 bits (`quantize --lm-head-bits 4`), per row in 8 bits (`serving.int8_linear`, quantize's default),
not at all where it stays 16-bit. Writes OUT.json and OUT.md."""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from bench.harness import RESULTS as BENCH_RESULTS
from leapctl.eval.perplexity import ids_perplexity, text_ids
from leapctl.models import load_model
from leapctl.quantize import lm_head_bits
from leapctl.runs import REPORT_FILE
from serving.int8_linear import int8_rows_activations
from serving.q4_linear import int8_activations

RESULTS = BENCH_RESULTS / "quality"


def rounded_linears(model: torch.nn.Module, group_size: int, head_bits: int) -> list:
    """Forward pre-hooks rounding the input of every nn.Linear as serving does (lm_head by its bits)."""
    hooks = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if not name.endswith("lm_head") or head_bits == 4:
            hooks.append(module.register_forward_pre_hook(
                lambda _m, args: (int8_activations(args[0], group_size).to(args[0].dtype),)))
        elif head_bits == 8:
            hooks.append(module.register_forward_pre_hook(
                lambda _m, args: (int8_rows_activations(args[0]).to(args[0].dtype),)))
    return hooks


def run_head_bits(run: Path) -> int:
    report = run / REPORT_FILE
    entry = json.loads(report.read_text()).get("quantization") or {} if report.is_file() else {}
    return lm_head_bits(entry)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--ppl", action="append", required=True, type=Path)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=0, help="windows per text (0: all)")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS / "quality_int8")
    args = parser.parse_args(argv)
    rows = []
    for run in args.runs:
        model, tokenizer = load_model(str(run))
        model.eval()
        row = {"run": str(run), "lm_head_bits": run_head_bits(run)}
        for text in args.ppl:
            ids = text_ids(tokenizer, text.read_text())
            if args.windows:
                ids = ids[: args.windows * args.seq_len + 1]
            plain = ids_perplexity(model, ids, args.seq_len)
            hooks = rounded_linears(model, args.group_size, row["lm_head_bits"])
            try:
                rounded = ids_perplexity(model, ids, args.seq_len)
            finally:
                for hook in hooks:
                    hook.remove()
            row[text.name] = {"bf16": plain, "int8": rounded, "ratio": rounded / plain}
            print(f"{run.name} {text.name}: {plain:.3f} -> {rounded:.3f} ({rounded / plain - 1:+.2%})",
                  flush=True)
        rows.append(row)
    load = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"rows": rows, "load": load}, indent=2))
    lines = [f"# int8 activations: perplexity cost ({time.strftime('%Y-%m-%d')}, load {load:.1f})", "",
             f"`python -m bench.quality int8 {' '.join(sys.argv[2:])}`; groups of {args.group_size} columns, "
             f"windows of {args.seq_len} tokens.", "",
             "| run | text | x as it is | int8 x | change |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        for text in args.ppl:
            r = row[text.name]
            lines.append(f"| {Path(row['run']).name} | {text.name} | {r['bf16']:.3f} | {r['int8']:.3f} | "
                         f"{r['ratio'] - 1:+.2%} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
