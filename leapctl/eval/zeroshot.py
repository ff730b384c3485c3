"""Zero-shot accuracy through lm-evaluation-harness, on task files read from a local folder.

The hub is never touched: each task's documents come from the shared assets (PIQA, WinoGrande, HellaSwag),
and the task is an lm-eval `ConfigurableTask` whose prompt, choices and target are those of lm-eval's own
`piqa`, `winogrande` and `hellaswag` YAMLs, so `acc` and `acc_norm` mean what lm-eval means by them:
`acc` picks the choice with the highest summed log-likelihood, `acc_norm` the highest log-likelihood per
character of the choice text (lm-eval divides by `len(choice)`). WinoGrande uses lm-eval's partial
scoring: each option is put into the sentence up to the blank and each such prefix scores the same
continuation, the rest of the sentence (acc only, as lm-eval reports).

The model is an already-loaded `transformers` model (wrapped in lm-eval's `HFLM`), so pruned in-memory
models are evaluated as they are.
"""

import bz2
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch

from leapctl.errors import LeapctlError
from leapctl.paths import assets_dir

TASKS = ("piqa", "winogrande", "hellaswag")
_TASK_FILES = {
    "piqa": ("piqa/valid.jsonl", "piqa/valid-labels.lst"),
    "winogrande": ("winogrande/dev.jsonl", "winogrande/dev-labels.lst"),
    "hellaswag": ("hellaswag/hellaswag_val_full.txt.bz2",),
}
HELLASWAG_LINES_PER_ITEM = 6


def resolve_tasks_dir(tasks_dir: str | Path | None = None) -> Path:
    """The folder holding `piqa/`, `winogrande/` and `hellaswag/`: explicit, else the shared assets."""
    folder = Path(tasks_dir).expanduser() if tasks_dir is not None else assets_dir()
    if folder is None:
        raise LeapctlError("no task files: pass --tasks-dir or set LEAPCTL_ASSETS to the assets folder")
    if not folder.is_dir():
        raise LeapctlError(f"task folder {folder} does not exist")
    return folder


def parse_tasks(spec: str | list[str]) -> list[str]:
    """`piqa,winogrande` -> ['piqa', 'winogrande']; unknown names are an error."""
    names = [name.strip() for name in (spec.split(",") if isinstance(spec, str) else spec) if name.strip()]
    unknown = [name for name in names if name not in TASKS]
    if unknown:
        raise LeapctlError(f"unknown task {unknown[0]!r} (known: {', '.join(TASKS)})")
    return names


def check_task_files(tasks: list[str], tasks_dir: str | Path | None = None) -> None:
    """Fail with one line before any model is loaded when a task's files are not there."""
    folder = resolve_tasks_dir(tasks_dir)
    for task in parse_tasks(tasks):
        for name in _TASK_FILES[task]:
            if not (folder / name).is_file():
                raise LeapctlError(f"{task}: task file {folder / name} not found")


def load_docs(task: str, tasks_dir: str | Path | None = None) -> list[dict]:
    """The evaluation documents of `task` as lm-eval's processed docs (after `process_docs`)."""
    folder = resolve_tasks_dir(tasks_dir)
    files = [folder / name for name in _TASK_FILES[parse_tasks([task])[0]]]
    missing = [str(path) for path in files if not path.is_file()]
    if missing:
        raise LeapctlError(f"{task}: task file {missing[0]} not found")
    try:
        return _READERS[task](*files)
    except (ValueError, KeyError, IndexError, OSError) as exc:
        raise LeapctlError(f"{task}: cannot read {files[0]}: {exc}") from None


def _read_piqa(questions: Path, labels: Path) -> list[dict]:
    rows = [json.loads(line) for line in questions.read_text().splitlines() if line.strip()]
    golds = [int(line) for line in labels.read_text().split()]
    _check_same_length(rows, golds, questions)
    return [{"goal": row["goal"], "sol1": row["sol1"], "sol2": row["sol2"], "label": gold}
            for row, gold in zip(rows, golds, strict=True)]


def _read_winogrande(questions: Path, labels: Path) -> list[dict]:
    rows = [json.loads(line) for line in questions.read_text().splitlines() if line.strip()]
    golds = labels.read_text().split()
    _check_same_length(rows, golds, questions)
    return [{"sentence": row["sentence"], "option1": row["option1"], "option2": row["option2"],
             "answer": gold} for row, gold in zip(rows, golds, strict=True)]


def _read_hellaswag(path: Path) -> list[dict]:
    """Six lines per item: `activity_label: ctx`, the gold index, four endings. The file holds `ctx`
    as one string (ctx_a, a space, ctx_b in lower case), so lm-eval's `ctx_a + " " + ctx_b.capitalize()`
    is rebuilt by capitalising the unfinished sentence after the last ". " when it starts in lower case."""
    lines = bz2.decompress(path.read_bytes()).decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % HELLASWAG_LINES_PER_ITEM:
        raise ValueError(f"{len(lines)} lines is not a multiple of {HELLASWAG_LINES_PER_ITEM}")
    docs = []
    for start in range(0, len(lines), HELLASWAG_LINES_PER_ITEM):
        context, label, *endings = lines[start:start + HELLASWAG_LINES_PER_ITEM]
        docs.append({
            "query": _hellaswag_preprocess(_capitalize_unfinished_sentence(context)),
            "choices": [_hellaswag_preprocess(ending) for ending in endings],
            "label": str(int(label)),
        })
    return docs


def _capitalize_unfinished_sentence(context: str) -> str:
    head, sep, tail = context.rpartition(". ")
    if sep and tail[:1].islower():
        return head + sep + tail.capitalize()
    return context


def _hellaswag_preprocess(text: str) -> str:
    """lm-eval's hellaswag `preprocess`: WikiHow bracket artefacts out, double spaces collapsed."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _check_same_length(rows: list, labels: list, path: Path) -> None:
    if len(rows) != len(labels):
        raise ValueError(f"{len(rows)} items but {len(labels)} labels")


_READERS: dict[str, Callable[..., list[dict]]] = {
    "piqa": _read_piqa, "winogrande": _read_winogrande, "hellaswag": _read_hellaswag,
}


def winogrande_choices(doc: dict) -> list[str]:
    """Both partial contexts: the sentence up to the blank with each option put in."""
    blank = doc["sentence"].index("_")
    return [doc["sentence"][:blank] + option for option in (doc["option1"], doc["option2"])]


def winogrande_target(doc: dict) -> str:
    """The shared continuation: the sentence after the blank."""
    return doc["sentence"][doc["sentence"].index("_") + 1:].strip()


def winogrande_gold(doc: dict) -> int:
    return {"1": 0, "2": 1}[doc["answer"]]


def _task_config(task: str, docs: list[dict]) -> dict:
    """The lm-eval task config with the prompts of lm-eval's own YAML for `task`."""
    import datasets

    metrics = [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]
    if task != "winogrande":
        metrics.append({"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True})
    config = {
        "task": task,
        "custom_dataset": lambda **_: {"validation": datasets.Dataset.from_list(docs)},
        "output_type": "multiple_choice",
        "validation_split": "validation",
        "metric_list": metrics,
        "metadata": {"version": 1.0},
    }
    if task == "piqa":
        config.update(doc_to_text="Question: {{goal}}\nAnswer:", doc_to_target="label",
                      doc_to_choice="{{[sol1, sol2]}}")
    elif task == "winogrande":
        config.update(doc_to_text=winogrande_gold, doc_to_target=winogrande_target,
                      doc_to_choice=winogrande_choices)
    else:
        config.update(doc_to_text="{{query}}", doc_to_target="{{label}}", doc_to_choice="choices")
    return config


def zero_shot(model: torch.nn.Module, tokenizer, tasks: list[str] | str = TASKS, limit: int | None = None,
              tasks_dir: str | Path | None = None, batch_size: int = 8,
              device: str | torch.device | None = None, per_item: bool = False) -> dict[str, dict]:
    """Zero-shot `acc` (and `acc_norm` where lm-eval reports it) and `n` per task, on the first `limit`
    items. `per_item` adds `items`: each item's choice log-likelihoods and its acc / acc_norm."""
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM

    names = parse_tasks(tasks)
    if not names:
        raise LeapctlError("no task given")
    if limit is not None and limit < 1:
        raise LeapctlError(f"--limit must be at least 1, got {limit}")
    # lm-eval's `limit` takes the first items; building the dataset from those alone is quicker.
    docs = {name: load_docs(name, tasks_dir)[:limit] for name in names}
    quiet = logging.getLogger("lm_eval")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # lm-eval warns about every custom dataset and in-memory model
    try:
        task_objects = {}
        for name in names:
            task = ConfigurableTask(config=_task_config(name, docs[name]))
            task.set_config(key="num_fewshot", value=0)
            task.set_fewshot_seed(seed=1234)
            task_objects[name] = task
        device = str(device or next(model.parameters()).device)
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device)
        # `evaluate` rather than `simple_evaluate`: the latter builds a TaskManager that indexes every
        # task YAML lm-eval ships, which takes longer than a small evaluation itself.
        out = evaluate(lm=lm, task_dict={"tasks": task_objects, "groups": {}, "group_map": {}},
                       limit=limit, bootstrap_iters=0, log_samples=per_item, verbosity="ERROR")
    finally:
        quiet.setLevel(level)
    results = {}
    for name in names:
        raw = out["results"][name]
        metrics = {metric: float(raw[f"{metric},none"]) for metric in ("acc", "acc_norm")
                   if f"{metric},none" in raw}
        metrics["n"] = int(out["n-samples"][name]["effective"])
        if per_item:
            samples = sorted(out["samples"][name], key=lambda sample: sample["doc_id"])
            metrics["items"] = [
                {"loglikelihoods": [float(ll) for ll, _ in sample["filtered_resps"]],
                 **{metric: float(sample[metric]) for metric in ("acc", "acc_norm") if metric in sample}}
                for sample in samples]
        results[name] = metrics
    return results
