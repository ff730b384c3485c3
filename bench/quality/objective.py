"""LEAP's objective on real calibration text: LM loss, distillation from the dense model, and mixes, at the
same budget from the same Wanda start, scored in domain and out of domain.

    .venv/bin/python -m bench.quality objective --models smollm2-135m,stories260k --threads 1

smollm2-135m (the demo's set-up, so that the answer column is what `make demo` serves): Wanda at 50% on
32 x 512 tokens of `wiki-summaries`, then LEAP from that mask for 150 steps x 4 x 256 tokens of
`wiki-summaries` (bf16 autocast, no gradient checkpointing: the demo's CPU settings; everything else at
the `auto` preset but the objective). Scored on the whole held-apart slice `wiki-summaries-heldout` (in
domain, 512-token windows), the first 64 windows of 512 tokens of WikiText-2 test (out of domain), PIQA,
WinoGrande and HellaSwag (first `--task-limit` items each) and the greedy answer (transformers, 32 new
tokens, the chat template) to the demo's question.
stories260k: calibration `generated` (the model's own samples: the teacher's distribution is the data),
quality.py's budget (200 steps x 8 x 128), scored on the TinyStories excerpt; SparseGPT from the same
calibration windows as the bar the defaults must beat (<= 0.67x its perplexity).

The objective is `LearnConfig.distill` d: the loss is (1 - d) * LM + d * KL(dense || masked).
Results: bench/results/quality/objective_<model>.{json,md}, rewritten after every row; rows not run this
time (the dense and baseline rows included) are kept from the last file when its settings are this run's."""

import argparse
import copy
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.harness import RESULTS as BENCH_RESULTS
from leapctl.data import WIKI_SUMMARIES_HELDOUT, calibration_batch, load_documents
from leapctl.eval.perplexity import ids_perplexity, read_wikitext, text_ids
from leapctl.learn import LearnConfig, leap_masks
from leapctl.models import load_model
from leapctl.paths import assets_dir
from leapctl.prune import METHODS

RESULTS = BENCH_RESULTS / "quality"
QUESTION = "What is the capital of France?"
# name -> distillation weight d (the LM loss gets 1 - d)
VARIANTS = {"distill": 1.0, "lm": 0.0, "mix-0.5": 0.5, "mix-0.2": 0.2}


def _asset(relative: str) -> Path:
    root = assets_dir()
    if root is None or not (root / relative).exists():
        sys.exit(f"error: shared asset {relative} not found (set LEAPCTL_ASSETS)")
    return root / relative


def _wikitext_windows(count: int, seq_len: int) -> Callable[[object], torch.Tensor]:
    def ids(tokenizer) -> torch.Tensor:
        text = read_wikitext(_asset("wikitext-2-raw/wiki.test.lf.raw"))
        return text_ids(tokenizer, text)[: count * seq_len]
    return ids


def _heldout(tokenizer) -> torch.Tensor:
    return text_ids(tokenizer, "\n\n".join(load_documents(WIKI_SUMMARIES_HELDOUT)))


def _tinystories(tokenizer) -> torch.Tensor:
    return text_ids(tokenizer, _asset("tinystories/valid_excerpt.txt").read_text())


@dataclass(frozen=True)
class Setup:
    name: str
    spec: Callable[[], str]
    calib: str
    wanda_windows: tuple[int, int]  # nsamples x seq_len of the Wanda (and SparseGPT) calibration
    budget: dict  # LearnConfig fields: the budget and CPU speed switches
    evals: dict[str, Callable[[object], torch.Tensor]]  # column -> token ids scored in eval_seq_len windows
    eval_seq_len: int
    tasks: tuple[str, ...] = ()
    answer: bool = False
    baselines: tuple[str, ...] = ("wanda",)
    notes: list[str] = field(default_factory=list)


SETUPS = {
    "smollm2-135m": Setup(
        name="smollm2-135m", spec=lambda: "smollm2-135m", calib="wiki-summaries", wanda_windows=(32, 512),
        budget=dict(steps=150, batch_size=4, seq_len=256, autocast=True, gradient_checkpointing=False),
        evals={"wiki-summaries-heldout": _heldout, "WikiText-2 (64 x 512)": _wikitext_windows(64, 512)},
        eval_seq_len=512, tasks=("piqa", "winogrande", "hellaswag"), answer=True),
    "stories260k": Setup(
        name="stories260k", spec=lambda: str(_asset("stories260K/hf")), calib="generated",
        wanda_windows=(128, 128), budget=dict(steps=200, batch_size=8, seq_len=128),
        evals={"TinyStories excerpt": _tinystories}, eval_seq_len=256, baselines=("wanda", "sparsegpt")),
}


def _answer(model, tokenizer) -> str:
    messages = [{"role": "user", "content": QUESTION}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=32, do_sample=False)
    return tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def _measure(model, tokenizer, setup: Setup, eval_ids: dict, task_limit: int) -> dict:
    from leapctl.eval import zero_shot

    started = time.perf_counter()
    row = {"ppl": {name: ids_perplexity(model, ids, setup.eval_seq_len, progress=False)
                   for name, ids in eval_ids.items()}}
    if setup.tasks:
        scores = zero_shot(model, tokenizer, list(setup.tasks), limit=task_limit)
        row["zeroshot"] = {task: 100 * s.get("acc_norm", s["acc"]) for task, s in scores.items()}
    if setup.answer:
        row["answer"] = _answer(model, tokenizer)
    row["eval_seconds"] = round(time.perf_counter() - started, 1)
    return row


def _write(setup: Setup, meta: dict, rows: list[dict]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"objective_{setup.name}.json").write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    columns = list(setup.evals)
    n, seq = setup.wanda_windows
    steps, batch, length = (setup.budget[k] for k in ("steps", "batch_size", "seq_len"))
    lines = [f"### {setup.name}: LEAP's objective at {meta['sparsity']:.0%}", "",
             f"Calibration `{setup.calib}`; Wanda (and SparseGPT) on {n} x {seq} tokens of it; LEAP from "
             f"that Wanda mask for {steps} steps x {batch} x {length} tokens, "
             f"preset `auto` but for `distill` d (loss (1-d) LM + d KL). Perplexity in {setup.eval_seq_len}-"
             f"token windows. Device: {meta['device']}; load: 1-minute load average at the row's start/end.",
             ""]
    if setup.tasks:
        lines += [f"Zero-shot (%, acc_norm for PIQA and HellaSwag, acc for WinoGrande): first "
                  f"{meta['task_limit']} items of each task.", ""]
    header = ["mask", "d", *[f"ppl {c}" for c in columns], *setup.tasks, "learn s", "load"]
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in rows:
        load = "/".join(f"{x:.1f}" for x in r["load"]) if r.get("load") else "-"
        cells = [r["mask"], "-" if r.get("distill") is None else f"{r['distill']:g}",
                 *[f"{r['ppl'][c]:.2f}" for c in columns],
                 *[f"{r['zeroshot'][t]:.1f}" for t in setup.tasks],
                 "-" if r.get("seconds") is None else f"{r['seconds']:.0f}", load]
        lines.append("| " + " | ".join(cells) + " |")
    if setup.answer:
        lines += ["", f"Greedy answer to \"{QUESTION}\" (32 new tokens, chat template):", ""]
        lines += [f"- {r['mask']}: {json.dumps(r['answer'])}" for r in rows]
    (RESULTS / f"objective_{setup.name}.md").write_text("\n".join(lines) + "\n")


def run_model(setup: Setup, variants: list[str], sparsity: float, task_limit: int) -> None:
    dense, tokenizer = load_model(setup.spec())
    eval_ids = {name: make(tokenizer) for name, make in setup.evals.items()}
    meta = {"model": setup.name, "sparsity": sparsity, "calib": setup.calib, "budget": setup.budget,
            "wanda_windows": setup.wanda_windows, "task_limit": task_limit,
            "device": f"cpu ({torch.get_num_threads()} threads)", "torch": torch.__version__,
            "python": platform.python_version()}
    path = RESULTS / f"objective_{setup.name}.json"
    earlier = json.loads(path.read_text()) if path.is_file() else {}
    same = {k: v for k, v in earlier.items() if k != "rows"} == json.loads(json.dumps(meta))
    rows = [r for r in earlier.get("rows", []) if same and r["mask"] not in variants]

    def add(row: dict) -> None:
        rows[:] = [r for r in rows if r["mask"] != row["mask"]] + [row]
        order = ["dense", *setup.baselines, *VARIANTS]
        rows.sort(key=lambda r: order.index(r["mask"]))
        _write(setup, meta, rows)
        print(f"{setup.name} {row['mask']}: {row['ppl']} {row.get('zeroshot', '')} {row.get('answer', '')}",
              flush=True)

    measured = {r["mask"] for r in rows}  # the dense and baseline rows are kept from the last file alike
    if "dense" not in measured:
        add({"mask": "dense", **_measure(dense, tokenizer, setup, eval_ids, task_limit)})
    n, seq = setup.wanda_windows
    calib_ids = calibration_batch(setup.calib, tokenizer, n, seq, 0, model=dense)
    start = None
    for method in setup.baselines:
        model = copy.deepcopy(dense)
        masks = METHODS[method].run(model, tokenizer, calib_ids, sparsity, progress=False)
        start = masks if method == "wanda" else start
        if method not in measured:
            add({"mask": method, **_measure(model, tokenizer, setup, eval_ids, task_limit)})
    for name in variants:
        model = copy.deepcopy(dense)
        config = LearnConfig(model=setup.name, sparsity=sparsity, calib=setup.calib, nsamples=n,
                             distill=VARIANTS[name], progress=False, **setup.budget)
        load, started = os.getloadavg()[0], time.perf_counter()
        leap_masks(model, tokenizer, setup.calib, config, init=start)
        seconds = time.perf_counter() - started
        add({"mask": name, "distill": VARIANTS[name], "seconds": round(seconds, 1),
             "load": [round(load, 2), round(os.getloadavg()[0], 2)],
             **_measure(model, tokenizer, setup, eval_ids, task_limit)})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="smollm2-135m,stories260k")
    parser.add_argument("--variants", default="distill,lm,mix-0.5", help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--sparsity", type=float, default=0.5)
    parser.add_argument("--task-limit", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"error: unknown variant(s) {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    for name in args.models.split(","):
        run_model(SETUPS[name], variants, args.sparsity, args.task_limit)


if __name__ == "__main__":
    main()
