"""Quality of pruning methods side by side: dense, magnitude, Wanda, SparseGPT and LEAP at 50% and 60%,
perplexity and optionally zero-shot accuracy.

    .venv/bin/python -m bench.quality prune --models stories260k,smollm2-135m --sparsities 0.5,0.6
    .venv/bin/python -m bench.quality prune --models smollm2-135m --methods leap \
        --tasks piqa,winogrande,hellaswag --task-limit 400

stories260k: calibration `generated` (128 x 128 tokens sampled from the model: its training text is not
here), evaluation on the TinyStories excerpt in 256-token windows over the concatenated stories.
smollm2-135m: calibration `wiki-summaries`, 128 x 512 tokens; evaluation on the WikiText-2 test split
(../shared/assets/wikitext-2-raw/wiki.test.lf.raw) in 512-token windows, as the pruning papers measure it.
Nothing is learned on evaluated text: LEAP trains on the calibration source (wiki-summaries without its
held-apart slice; for stories260k, text sampled from the model itself).

Every method comes from METHODS below (the one-shot registry `leapctl.prune.METHODS` plus
`leapctl.learn.LEAP`) and runs in memory on a fresh copy of the dense
model: the one-shot methods on the calibration batch (drawn once per model, shared), LEAP (`leap_masks`) on
the calibration source's token stream, starting from the Wanda row's masks when Wanda ran first at that
sparsity (the masks it would compute itself: same windows, same seed). Its wall time is recorded.
Results go to bench/results/quality/quality_<model>.{json,md}, rewritten after every run; the rows of methods
and sparsities not run this time are kept from the last file when its calibration and evaluation are the same
(`--methods leap` redoes LEAP alone). LEAP runs with the model's LEAP_SETTINGS (the defaults otherwise);
`--leap KEY=VALUE` overrides a `LearnConfig` field and `--leap-name NAME` files the run as its own row
(e.g. `--leap distill=0 --leap-name leap-lm` for an ablation), its settings recorded with it."""

import argparse
import copy
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.harness import RESULTS as BENCH_RESULTS
from leapctl.data import calibration_batch
from leapctl.eval.perplexity import perplexity, read_wikitext
from leapctl.learn import LEAP
from leapctl.masks import MaskSet
from leapctl.models import load_model
from leapctl.paths import assets_dir
from leapctl.prune import METHODS as ONE_SHOT_METHODS

# Every method bench compares: the one-shot registry, then LEAP (offered by leapctl.learn).
METHODS = {**ONE_SHOT_METHODS, "leap": LEAP}

RESULTS = BENCH_RESULTS / "quality"


@dataclass(frozen=True)
class ModelSetup:
    """A model and how it is calibrated and evaluated."""

    name: str
    spec: Callable[[], str]  # the MODEL argument, resolved lazily (assets may be elsewhere)
    calib: str
    nsamples: int
    seq_len: int
    eval_text: Callable[[], str]
    eval_name: str
    eval_seq_len: int
    seed: int = 0


def _asset(relative: str) -> Path:
    root = assets_dir()
    if root is None or not (root / relative).exists():
        sys.exit(f"error: shared asset {relative} not found (set LEAPCTL_ASSETS)")
    return root / relative


MODELS: dict[str, ModelSetup] = {
    "stories260k": ModelSetup(
        name="stories260k", spec=lambda: str(_asset("stories260K/hf")), calib="generated", nsamples=128,
        seq_len=128, eval_text=lambda: _asset("tinystories/valid_excerpt.txt").read_text(),
        eval_name="TinyStories valid excerpt", eval_seq_len=256),
    "smollm2-135m": ModelSetup(
        name="smollm2-135m", spec=lambda: "smollm2-135m", calib="wiki-summaries", nsamples=128, seq_len=512,
        eval_text=lambda: read_wikitext(_asset("wikitext-2-raw/wiki.test.lf.raw")),
        eval_name="WikiText-2 test", eval_seq_len=512),
}

# LEAP's budget per model: the defaults (preset `auto`) but for the budget and the CPU speed settings.
# stories260k: the budget, 200 steps x 8 x 128 tokens, everything else at its default.
# smollm2-135m: 360 steps x 2 x 512 tokens; bf16 autocast and no gradient checkpointing only make the CPU
# steps faster (memory is no concern at this size).
LEAP_SETTINGS: dict[str, dict] = {
    "stories260k": dict(steps=200, batch_size=8, seq_len=128),
    "smollm2-135m": dict(steps=360, batch_size=2, seq_len=512, gradient_checkpointing=False, autocast=True),
}


def _run_method(method: str, model, tokenizer, calib_ids: torch.Tensor, sparsity: float, setup: ModelSetup,
                earlier: dict[str, MaskSet], leap: dict) -> MaskSet:
    """One registry method on `model` (pruned in place); LEAP learns on the calibration source's stream."""
    kind = METHODS[method].data
    if kind == "none":
        return METHODS[method].run(model, tokenizer, None, sparsity)
    if kind == "calibration":
        return METHODS[method].run(model, tokenizer, calib_ids, sparsity, progress=False)
    settings = dict(calib=setup.calib, nsamples=calib_ids.shape[0], seed=setup.seed, **leap)
    return METHODS[method].run(model, tokenizer, setup.calib, sparsity, init=earlier.get("wanda"), **settings)


def _eval_text(setup: ModelSetup, tokenizer, max_tokens: int | None) -> str:
    """The evaluation text, optionally cut at a paragraph boundary after about `max_tokens` tokens."""
    text = setup.eval_text()
    if max_tokens is None:
        return text
    kept, count = [], 0
    for paragraph in text.split("\n\n"):
        kept.append(paragraph)
        count += len(tokenizer(paragraph, add_special_tokens=False)["input_ids"])
        if count >= max_tokens:
            break
    return "\n\n".join(kept)


def _cell(row: dict, task: str) -> str:
    """A zero-shot table cell: acc_norm where lm-eval reports it (PIQA, HellaSwag), else acc."""
    scores = row.get("zeroshot", {}).get(task)
    if not scores:
        return "-"
    return f"{100 * scores.get('acc_norm', scores['acc']):.1f}"


def _write(setup: ModelSetup, meta: dict, rows: list[dict]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"quality_{setup.name}.json").write_text(json.dumps({**meta, "runs": rows}, indent=2) + "\n")
    dense = next((r["ppl"] for r in rows if r["method"] == "dense"), None)
    evaluation, calib = meta["eval"], meta["calibration"]
    cap = evaluation["max_tokens"]
    limit = "the whole text" if cap is None else f"the first ~{cap} tokens"
    tasks = sorted({task for r in rows for task in r.get("zeroshot", {})})
    counts = {task: sorted({r["zeroshot"][task]["n"] for r in rows if task in r.get("zeroshot", {})})
              for task in tasks}
    lines = [f"### {setup.name}: perplexity on {evaluation['text']} ({evaluation['seq_len']}-token windows, "
             f"{limit})",
             "",
             f"Calibration: `{setup.calib}`, {calib['nsamples']} x {calib['seq_len']} tokens, "
             f"seed {setup.seed}. Device: {meta['device']}. Time: pruning or learning wall time; load: the "
             f"1-minute load average at its start and end.",
             ""]
    if tasks:
        lines += ["Zero-shot accuracy (%): " + ", ".join(
            f"{task} {'acc_norm' if task != 'winogrande' else 'acc'} on the first "
            f"{'/'.join(str(n) for n in counts[task])} items" for task in tasks) + ".", ""]
    header = ["method", "target sparsity", "achieved", "perplexity", "vs dense", "time (s)", "load", *tasks]
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in rows:
        ratio = f"{r['ppl'] / dense:.2f}x" if dense else ""
        target = "-" if r["target"] is None else f"{r['target']:.0%}"
        achieved = "-" if r["achieved"] is None else f"{r['achieved']:.4f}"
        seconds = "-" if r["seconds"] is None else f"{r['seconds']:.1f}"
        load = "-" if not r.get("load") else "/".join(f"{x:.1f}" for x in r["load"])
        cells = [r["method"], target, achieved, f"{r['ppl']:.3f}", ratio, seconds, load,
                 *[_cell(r, task) for task in tasks]]
        lines.append("| " + " | ".join(cells) + " |")
    settings = [f"- {r['method']} {r['target']:.0%}: {r['settings']}" for r in rows if r.get("settings")]
    if settings:
        lines += ["", "Learned rows' settings (resolved; budget: steps x batch_size x seq_len tokens):", "",
                  *settings]
    (RESULTS / f"quality_{setup.name}.md").write_text("\n".join(lines) + "\n")


def _earlier(setup: ModelSetup, meta: dict) -> list[dict]:
    """The rows of the last results file when its calibration and evaluation are this run's."""
    path = RESULTS / f"quality_{setup.name}.json"
    if not path.is_file():
        return []
    earlier = json.loads(path.read_text())

    def calibration(m: dict) -> dict:
        return {k: v for k, v in m.get("calibration", {}).items() if k != "seconds"}

    if calibration(earlier) != calibration(meta) or earlier.get("eval") != meta["eval"]:
        return []
    return earlier.get("runs", [])


def _rows_kept_from_earlier(setup: ModelSetup, meta: dict, methods: list[str],
                            sparsities: list[float]) -> list[dict]:
    """The rows of the last run with the same calibration and evaluation that this run does not redo, so
    that a method or a sparsity can be run again (an hour of LEAP) without redoing the rest of the table."""
    return [r for r in _earlier(setup, meta)
            if r["method"] != "dense" and not (r["method"] in methods and r["target"] in sparsities)]


def _kept_dense(setup: ModelSetup, meta: dict, tasks: list[str], task_limit: int | None) -> dict | None:
    """The last run's dense row, when it was measured the same way (and on the zero-shot tasks asked)."""
    for row in _earlier(setup, meta):
        if row["method"] == "dense" and all(
                row.get("zeroshot", {}).get(t, {}).get("limit", "none") == task_limit for t in tasks):
            return row
    return None


def _table_order(rows: list[dict]) -> list[dict]:
    """Dense first, then by sparsity (highest first), methods in the order of METHODS (a named LEAP variant
    after LEAP)."""
    methods = list(METHODS)

    def rank(method: str) -> tuple:
        base = method if method in methods else method.split("-", 1)[0]
        return (methods.index(base) if base in methods else len(methods), method != base, method)

    def key(row: dict) -> tuple:
        if row["target"] is None:
            return (0, 0.0, (0, False, ""))
        return (1, -row["target"], rank(row["method"]))

    return sorted(rows, key=key)


def _measure(model, tokenizer, text: str, setup: ModelSetup, tasks: list[str],
             task_limit: int | None) -> dict:
    """Perplexity (and zero-shot accuracy on the first `task_limit` items of each task) of one model."""
    from leapctl.eval import zero_shot

    started = time.perf_counter()
    out = {"ppl": perplexity(model, tokenizer, text, seq_len=setup.eval_seq_len)}
    if tasks:
        scores = zero_shot(model, tokenizer, tasks, limit=task_limit)
        out["zeroshot"] = {task: {**values, "limit": task_limit} for task, values in scores.items()}
    out["eval_seconds"] = round(time.perf_counter() - started, 1)
    return out


def run_model(setup: ModelSetup, methods: list[str], sparsities: list[float], nsamples: int | None,
              eval_tokens: int | None, tasks: list[str], task_limit: int | None,
              leap_name: str) -> list[dict]:
    dense, tokenizer = load_model(setup.spec())
    text = _eval_text(setup, tokenizer, eval_tokens)
    nsamples = nsamples or setup.nsamples
    started = time.perf_counter()
    calib_ids = calibration_batch(setup.calib, tokenizer, nsamples, setup.seq_len, setup.seed, model=dense)
    meta = {
        "model": setup.name,
        "calibration": {"source": setup.calib, "nsamples": nsamples, "seq_len": setup.seq_len,
                        "seed": setup.seed, "seconds": round(time.perf_counter() - started, 1)},
        "eval": {"text": setup.eval_name, "seq_len": setup.eval_seq_len, "max_tokens": eval_tokens},
        "device": "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__, "python": platform.python_version(),
    }
    dense_row = _kept_dense(setup, meta, tasks, task_limit)
    if dense_row is None:
        dense_row = {"method": "dense", "target": None, "achieved": None, "seconds": None,
                     **_measure(dense, tokenizer, text, setup, tasks, task_limit)}
    labels = [leap_name if method == "leap" else method for method in methods]
    rows = [dense_row, *_rows_kept_from_earlier(setup, meta, labels, sparsities)]
    _write(setup, meta, _table_order(rows))
    for sparsity in sparsities:
        earlier: dict[str, MaskSet] = {}
        for method, label in zip(methods, labels, strict=True):
            model = copy.deepcopy(dense)
            load = os.getloadavg()[0]
            started = time.perf_counter()
            masks = _run_method(method, model, tokenizer, calib_ids, sparsity, setup, earlier,
                                LEAP_SETTINGS[setup.name])
            earlier[method] = masks
            seconds = time.perf_counter() - started
            row = {"method": label, "target": sparsity, "achieved": masks.sparsity()["global"],
                   "seconds": round(seconds, 1), "load": [round(load, 2), round(os.getloadavg()[0], 2)],
                   **_measure(model, tokenizer, text, setup, tasks, task_limit)}
            if method == "leap":
                row["settings"] = masks.stats["settings"]
                row["tokens_per_s"] = round(masks.stats["tokens_per_s"], 1)
            rows = [r for r in rows if not (r["method"] == label and r["target"] == sparsity)] + [row]
            print(f"{setup.name} {label} {sparsity:.0%}: ppl {row['ppl']:.3f} ({seconds:.1f}s)", flush=True)
            _write(setup, meta, _table_order(rows))
            del model
    return rows


def _leap_override(text: str) -> tuple[str, object]:
    """`key=value` for a LearnConfig field; the value is read as a Python literal (true/false allowed)."""
    import ast
    import dataclasses

    from leapctl.learn import LearnConfig

    key, sep, value = text.partition("=")
    fields = {f.name for f in dataclasses.fields(LearnConfig)}
    if not sep or key not in fields:
        sys.exit(f"error: --leap wants KEY=VALUE with KEY a LearnConfig field, got {text!r}")
    words = {"true": True, "false": False, "none": None}
    try:
        return key, words[value.lower()] if value.lower() in words else ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def main(argv: list[str] | None = None) -> None:
    from leapctl.eval import parse_tasks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="stories260k,smollm2-135m")
    parser.add_argument("--sparsities", default="0.5,0.6")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--nsamples", type=int, default=None, help="override the calibration sample count")
    parser.add_argument("--eval-tokens", type=int, default=None,
                        help="evaluate on about the first N tokens only (default: the whole text)")
    parser.add_argument("--tasks", default="", help="zero-shot tasks too, e.g. piqa,winogrande,hellaswag")
    parser.add_argument("--task-limit", type=int, default=None, help="first N items of each task")
    parser.add_argument("--leap", action="append", default=[], metavar="KEY=VALUE",
                        help="override a LEAP_SETTINGS entry (a LearnConfig field), e.g. steps=200")
    parser.add_argument("--leap-name", default="leap", help="file the LEAP run under this row name")
    args = parser.parse_args(argv)
    overrides = dict(_leap_override(text) for text in args.leap)
    models = args.models.split(",")
    methods = args.methods.split(",")
    for name in models:
        if name not in MODELS:
            sys.exit(f"error: unknown model {name!r} (choose from {', '.join(MODELS)})")
    for name in methods:
        if name not in METHODS:
            sys.exit(f"error: unknown method {name!r} (choose from {', '.join(METHODS)})")
    tasks = parse_tasks(args.tasks) if args.tasks else []
    sparsities = [float(s) for s in args.sparsities.split(",")]
    for name in models:
        LEAP_SETTINGS[name].update(overrides)  # recorded with each learned row
        run_model(MODELS[name], methods, sparsities, args.nsamples, args.eval_tokens, tasks, args.task_limit,
                  args.leap_name)
        print((RESULTS / f"quality_{name}.md").read_text())


if __name__ == "__main__":
    main()
