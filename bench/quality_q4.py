"""Which order gives the best 4-bit sparse model: prune (Wanda or LEAP) with 16-bit values, then quantize the
kept weights (round to nearest or GPTQ with the mask fixed), or quantize first and learn the LEAP mask
against the quantized weights (`learn --bits 4`). Every variant goes through the CLI a user would run, at
the same budget, and is scored by `leapctl eval` perplexity on held-out text.

    python bench/quality_q4.py                       # stories260K (fp32-trained; about 20 min on 2 cores)
    python bench/quality_q4.py --model smollm2-135m --calib wiki-summaries --ppl wiki-summaries-heldout

stories260K's down_proj has 172 input columns, which no group of whole 32-column words divides, so on that
model down_proj is left unpruned and dense in every variant (`--exclude down_proj`)."""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def leapctl(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "leapctl", *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"leapctl {' '.join(args)} failed:\n{done.stderr[-2000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="../shared/assets/stories260K/hf")
    parser.add_argument("--calib", default="generated")
    parser.add_argument("--ppl", action="append", default=None)
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--exclude", default="down_proj")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--nsamples", type=int, default=64)
    parser.add_argument("--work", type=Path, default=Path("runs/quality_q4"))
    parser.add_argument("--name", default="stories260k")
    args = parser.parse_args()
    ppl = args.ppl or ["../shared/assets/tinystories/valid_excerpt.txt"]
    work = args.work / f"{args.name}-{args.sparsity}"
    work.mkdir(parents=True, exist_ok=True)
    common = ["--calib", args.calib, "--nsamples", str(args.nsamples), "--seq-len", str(args.seq_len),
              "--no-progress"]
    scope = ["--exclude", args.exclude] if args.exclude else []
    learn = ["--sparsity", str(args.sparsity), "--steps", str(args.steps), "--batch-size",
             str(args.batch_size), *common, *scope, "--overwrite"]
    runs: dict[str, Path] = {}
    timings: dict[str, float] = {}

    def make(name: str, *cli: str) -> None:
        started = time.perf_counter()
        leapctl(*cli, "--out", str(work / name))
        runs[name], timings[name] = work / name, round(time.perf_counter() - started, 1)
        print(f"{name}: {timings[name]} s", flush=True)

    make("wanda", "prune", args.model, "--method", "wanda", "--sparsity", str(args.sparsity), *common, *scope,
         "--overwrite")
    make("leap", "learn", args.model, *learn)
    q = ["--group-size", str(args.group_size), "--overwrite"]
    for source in ("wanda", "leap"):
        make(f"{source} + rtn", "quantize", str(work / source), "--method", "rtn", *q)
        make(f"{source} + gptq", "quantize", str(work / source), "--method", "gptq", *common, *q)
    make("learn --bits 4", "learn", args.model, *learn, "--bits", "4", "--group-size", str(args.group_size))
    out = work / "eval.json"
    leapctl("eval", args.model, *[str(p) for p in runs.values()], *sum((["--ppl", p] for p in ppl), []),
            "--json", str(out))
    results = json.loads(out.read_text())
    names = ["dense", *runs]
    texts = results["settings"]["ppl"]
    table = ["| variant | " + " | ".join(f"ppl {name}" for name in texts) + " | seconds |",
             "| --- | " + " | ".join("---" for _ in texts) + " | --- |"]
    record = {}
    for name, entry in zip(names, results["models"], strict=True):
        scores = {p: entry["perplexity"][p]["ppl"] for p in results["settings"]["ppl"]}
        record[name] = {"perplexity": scores, "sparsity": entry["sparsity"], "seconds": timings.get(name)}
        table.append(f"| {name} | " + " | ".join(f"{v:.3f}" for v in scores.values())
                     + f" | {timings.get(name, '')} |")
    text = (f"# 4-bit sparse quality: {args.name}, {args.sparsity:.0%}, group {args.group_size}\n\n"
            f"`python bench/quality_q4.py {' '.join(sys.argv[1:])}` ({time.strftime('%Y-%m-%d')}, 2-core AMD "
            f"EPYC, CPU). LEAP: {args.steps} steps x {args.batch_size} x {args.seq_len} tokens, defaults; "
            f"calibration {args.calib}, {args.nsamples} x {args.seq_len}; excluded: "
            f"{args.exclude or 'none'}.\n\n"
            + "\n".join(table) + "\n")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"quality_q4_{args.name}.md").write_text(text)
    settings = vars(args) | {"work": str(args.work)}
    (RESULTS / f"quality_q4_{args.name}.json").write_text(
        json.dumps({"args": settings, "results": record}, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
