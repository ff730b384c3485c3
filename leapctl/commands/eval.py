"""`leapctl eval MODEL...`: perplexity and zero-shot accuracy of several models side by side. From Python:
`run(EvalConfig(...))` returns the results; `leapctl.eval` has the measurements themselves."""

import json
from collections.abc import Iterable
from pathlib import Path

from leapctl.errors import LeapctlError
from leapctl.eval.config import EvalConfig
from leapctl.paths import check_creatable, write_text_atomically

NAME = "eval"
HELP = ("Perplexity (non-overlapping windows, as the pruning papers measure WikiText-2) and zero-shot "
        "accuracy (lm-eval acc / acc_norm) of each MODEL, printed as a table, optionally saved as JSON.")
Config = EvalConfig
# eval writes a few kilobytes a model: a bigger file is no earlier result, and is not read whole to tell
RESULT_MAX_BYTES = 1 << 20


def run(config: EvalConfig) -> dict:
    """Check the settings, load the texts, evaluate every model, write `--json` atomically;
    returns the results."""
    from leapctl.compute import dtype_from_name, resolve_device
    from leapctl.eval import WIKITEXT2, evaluate_models, load_ppl_texts, parse_tasks

    dtype = dtype_from_name(config.dtype)
    device = resolve_device(config.device)
    task_names = parse_tasks(config.tasks)
    ppl_specs = config.ppl or ([] if task_names else [WIKITEXT2])
    if config.json_out is not None:  # now, not after the models have run
        _check_json_out(config.json_out, config.overwrite, _inputs(config, ppl_specs, task_names))
    texts = load_ppl_texts(ppl_specs)
    results = evaluate_models(config.models, texts, task_names, seq_len=config.seq_len, limit=config.limit,
                              tasks_dir=config.tasks_dir, device=str(device), dtype=dtype,
                              batch_size=config.batch_size, progress=config.progress)
    if config.json_out is not None:
        write_text_atomically(config.json_out, json.dumps(results, indent=2) + "\n")
    return results


def main(config: EvalConfig) -> int:
    _print_table(run(config))
    return 0


def _inputs(config: EvalConfig, ppl_specs: list[str], task_names: list[str]) -> list[Path]:
    """What eval reads: the --ppl files (`wikitext2`'s in the assets), the local model folders and, with
    --tasks, the task folder."""
    from leapctl.eval import WIKITEXT2, WIKITEXT2_FILE
    from leapctl.paths import assets_dir

    assets = assets_dir()
    found = [Path(spec).expanduser() for spec in [*ppl_specs, *config.models] if spec != WIKITEXT2]
    if WIKITEXT2 in ppl_specs and assets is not None:
        found.append(assets / WIKITEXT2_FILE)
    tasks_dir = config.tasks_dir or assets
    return found + ([Path(tasks_dir).expanduser()] if task_names and tasks_dir is not None else [])


def _check_json_out(path: Path, overwrite: bool, inputs: Iterable[Path]) -> None:
    """Refuse a --json FILE that cannot or must not be written, before any model loads (an hour of
    evaluation lost to a typo otherwise): one of the command's inputs or a file in an input folder, even
    with `overwrite`; without it, an existing file that is not an earlier eval result; a place with no
    writable folder."""
    if path.is_dir():
        raise LeapctlError(f"--json {path} is a folder")
    if path.exists() or path.is_symlink():
        target = path.resolve()
        for given in inputs:
            if given.exists() and (given.resolve() == target or given.resolve() in target.parents):
                raise LeapctlError(f"--json {path} would replace this command's input {given}; choose "
                                   f"another file")
        if not overwrite and not _is_eval_result(path):
            raise LeapctlError(f"--json {path} exists and is not an earlier eval result (use --overwrite to "
                               f"replace it)")
    check_creatable(path, f"--json {path}")  # write_text_atomically makes the missing folders


def _is_eval_result(path: Path) -> bool:
    """Whether `path` holds what `run` writes: {"settings": {...}, "models": [{"model": ...}, ...]}."""
    try:
        if path.stat().st_size > RESULT_MAX_BYTES:
            return False
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # UnicodeDecodeError is a ValueError
        return False
    return (isinstance(data, dict) and set(data) == {"settings", "models"}
            and isinstance(data["settings"], dict) and isinstance(data["models"], list)
            and all(isinstance(entry, dict) and "model" in entry for entry in data["models"]))


def _label(spec: str) -> str:
    """A short column title: the last two parts of a path (`stories260K/hf`), a name or hub id as is."""
    path = Path(spec)
    return "/".join(path.parts[-2:]) if path.exists() else spec


def _print_table(results: dict) -> None:
    """One column per model, one row per measured number."""
    from rich.console import Console
    from rich.table import Table

    entries = results["models"]
    table = Table(title="leapctl eval")
    table.add_column("metric")
    for entry in entries:
        table.add_column(_label(entry["model"]), justify="right", overflow="fold")
    table.add_row("sparsity (decoder linears)", *[f"{entry['sparsity']:.1%}" for entry in entries])
    for name in results["settings"]["ppl"]:
        scores = [entry["perplexity"][name] for entry in entries]
        windows = sorted({score["seq_len"] for score in scores})
        table.add_row(f"ppl {name} (seq {'/'.join(map(str, windows))})", *[f"{s['ppl']:.3f}" for s in scores])
        if "ppl_docs" in scores[0]:
            table.add_row(f"ppl {name} (per document)", *[f"{s['ppl_docs']:.3f}" for s in scores])
    for task in results["settings"]["tasks"]:
        for metric in ("acc", "acc_norm"):
            if metric in entries[0]["zeroshot"][task]:
                n = entries[0]["zeroshot"][task]["n"]
                table.add_row(f"{task} {metric} (n={n})",
                              *[f"{entry['zeroshot'][task][metric]:.4f}" for entry in entries])
    Console().print(table)
