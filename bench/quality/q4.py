"""Which order gives the best 4-bit sparse model: prune (Wanda or LEAP) with 16-bit values, then quantize the
kept weights (round to nearest or GPTQ with the mask fixed), or quantize first and learn the LEAP mask
against the quantized weights (`learn --bits 4`); and what `quantize`'s end-to-end scale tuning (its
default, `--tune-steps 200`) adds to LEAP + GPTQ (the other quantized variants run with `--tune-steps 0`).
Every variant goes through the CLI a user would run, at the same budget, and is scored by `leapctl eval`
perplexity on held-out text.

    python -m bench.quality q4                       # stories260K (fp32-trained; about 20 min on 2 cores)
    python -m bench.quality q4 --model smollm2-135m --name smollm2-135m --calib wiki-summaries --exclude "" \
        --ppl wiki-summaries-heldout --ppl wikitext2-60k --steps 150 --batch-size 4 --seq-len 256 \
        --nsamples 128 --eval-seq-len 1024 --lm-head

stories260K's down_proj has 172 input columns, which no group of whole 32-column words divides, so on that
model down_proj is left unpruned and dense in every variant (`--exclude down_proj`)."""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import RESULTS as BENCH_RESULTS

RESULTS = BENCH_RESULTS / "quality"


def leapctl(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "leapctl", *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"leapctl {' '.join(args)} failed:\n{done.stderr[-2000:]}")


def text_file(name: str, work: Path) -> str:
    """An evaluation text as a file `leapctl eval --ppl` reads: `wikitext2-60k` is the first 60,000
    characters of WikiText-2's test split (issue 19's table), `wiki-summaries-heldout` the held-apart
    summaries, one paragraph each; anything else is a path already."""
    from leapctl.data import load_documents
    from leapctl.paths import assets_dir

    path = work / f"{name}.txt"
    if name == "wikitext2-60k":
        if assets_dir() is None:
            raise SystemExit("WikiText-2 needs ../shared/assets (or $LEAPCTL_ASSETS)")
        path.write_text((assets_dir() / "wikitext-2-raw" / "wiki.test.lf.raw").read_text()[:60_000])
    elif name == "wiki-summaries-heldout":
        path.write_text("\n\n".join(load_documents(name)))
    else:
        return name
    return str(path)


def dense_run(model: str, exclude: str | None, out: Path) -> None:
    """A run folder of the dense model whose masks keep every weight: what `quantize` makes a dense 4-bit
    model of (GPTQ or RTN on every weight), the reference for what sparsity adds."""
    import torch

    from leapctl.masks import MaskSet
    from leapctl.models import load_model, model_layout
    from leapctl.runs import save_run

    loaded, tokenizer = load_model(model, dtype=torch.float32)
    linears = model_layout(loaded, None, exclude or None).linears
    masks = {f"{name}.weight": torch.ones(linear.weight.shape, dtype=torch.bool)
             for name, linear in linears.items()}
    out.mkdir(parents=True, exist_ok=True)
    save_run(out, loaded, tokenizer, MaskSet(masks=masks, model=model),
             {"command": "bench", "method": "dense"})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    parser.add_argument("--eval-seq-len", type=int, default=None)
    parser.add_argument("--lm-head", action="store_true", help="add LEAP + GPTQ with lm_head in 4 bits")
    parser.add_argument("--no-learn-bits", action="store_true",
                        help="leave out `learn --bits 4` (a second LEAP run; on stories260K it lost to "
                             "LEAP + GPTQ)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work = args.work / f"{args.name}-{args.sparsity}"
    work.mkdir(parents=True, exist_ok=True)
    ppl = [text_file(p, work) for p in args.ppl or ["../shared/assets/tinystories/valid_excerpt.txt"]]
    common = ["--calib", args.calib, "--nsamples", str(args.nsamples), "--seq-len", str(args.seq_len),
              "--no-progress"]
    scope = ["--exclude", args.exclude] if args.exclude else []
    learn = ["--sparsity", str(args.sparsity), "--steps", str(args.steps), "--batch-size",
             str(args.batch_size), *common, *scope, "--overwrite"]
    runs: dict[str, Path] = {}
    timings: dict[str, float] = {}

    def make(name: str, *cli: str) -> None:
        """Run a leapctl command into WORK/name, unless an earlier run of this script finished it."""
        runs[name] = work / name
        if (work / name / "report.json").is_file():
            print(f"{name}: kept from an earlier run", flush=True)
            return
        started = time.perf_counter()
        leapctl(*cli, "--out", str(work / name))
        timings[name] = round(time.perf_counter() - started, 1)
        print(f"{name}: {timings[name]} s", flush=True)

    dense = work / "dense-run"
    if not (dense / "report.json").is_file():
        dense_run(args.model, args.exclude, dense)
    # The decoder's 4-bit cost alone (lm_head as it is), and with quantize's defaults (scale tuning, lm_head
    # in 8 bits)
    q = ["--group-size", str(args.group_size), "--tune-steps", "0", "--lm-head-bits", "16", "--overwrite"]
    tuned = ["--group-size", str(args.group_size), "--overwrite"]
    make("dense + rtn", "quantize", str(dense), "--method", "rtn", *q)
    make("dense + gptq", "quantize", str(dense), "--method", "gptq", *common, *q)

    make("wanda", "prune", args.model, "--method", "wanda", "--sparsity", str(args.sparsity), *common, *scope,
         "--overwrite")
    make("leap", "learn", args.model, *learn)
    for source in ("wanda", "leap"):
        make(f"{source} + rtn", "quantize", str(work / source), "--method", "rtn", *q)
        make(f"{source} + gptq", "quantize", str(work / source), "--method", "gptq", *common, *q)
    make("leap + gptq + tuned scales", "quantize", str(work / "leap"), "--method", "gptq", *common, *tuned)
    if args.lm_head:
        make("leap + gptq, lm_head 4-bit", "quantize", str(work / "leap"), "--method", "gptq", *common, *q,
             "--lm-head-bits", "4")
    if not args.no_learn_bits:
        make("learn --bits 4", "learn", args.model, *learn, "--bits", "4", "--group-size",
             str(args.group_size))
    out = work / "eval.json"
    window = ["--seq-len", str(args.eval_seq_len)] if args.eval_seq_len else []
    leapctl("eval", args.model, *[str(p) for p in runs.values()], *sum((["--ppl", p] for p in ppl), []),
            *window, "--json", str(out))
    write_results(args, json.loads(out.read_text()), ["dense", *runs], timings)


def write_results(args: argparse.Namespace, results: dict, names: list[str],
                  timings: dict[str, float]) -> None:
    """bench/results/quality/quality_q4_NAME.{md,json}: one row per variant (`names`: eval's columns)."""
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
            f"`python -m bench.quality q4 {' '.join(sys.argv[2:])}` ({time.strftime('%Y-%m-%d')}, 2-core AMD "
            f"EPYC, CPU). LEAP: {args.steps} steps x {args.batch_size} x {args.seq_len} tokens, defaults; "
            f"calibration {args.calib}, {args.nsamples} x {args.seq_len}; excluded: "
            f"{args.exclude or 'none'}.\n\n"
            + "\n".join(table) + "\n")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"quality_q4_{args.name}.md").write_text(text)
    settings = vars(args) | {"work": str(args.work)}
    (RESULTS / f"quality_q4_{args.name}.json").write_text(
        json.dumps({"args": settings, "results": record}, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
