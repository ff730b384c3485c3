"""`leapctl eval MODEL...`: perplexity and zero-shot accuracy of several models side by side. From Python:
`run(EvalConfig(...))` returns the results; `leapctl.eval` has the measurements themselves."""

import json
from pathlib import Path

from leapctl.eval.config import EvalConfig
from leapctl.paths import write_text_atomically

NAME = "eval"
HELP = ("Perplexity (non-overlapping windows, as the pruning papers measure WikiText-2) and zero-shot "
        "accuracy (lm-eval acc / acc_norm) of each MODEL, printed as a table, optionally saved as JSON.")
Config = EvalConfig


def run(config: EvalConfig) -> dict:
    """Check the settings, load the texts, evaluate every model, write `--json` atomically;
    returns the results."""
    from leapctl.compute import dtype_from_name, resolve_device
    from leapctl.errors import LeapctlError
    from leapctl.eval import WIKITEXT2, evaluate_models, load_ppl_text, parse_tasks

    dtype = dtype_from_name(config.dtype)
    device = resolve_device(config.device)
    task_names = parse_tasks(config.tasks)
    texts = [load_ppl_text(spec) for spec in (config.ppl or ([] if task_names else [WIKITEXT2]))]
    if config.json_out is not None and config.json_out.is_dir():
        raise LeapctlError(f"--json {config.json_out} is a folder")
    results = evaluate_models(config.models, texts, task_names, seq_len=config.seq_len, limit=config.limit,
                              tasks_dir=config.tasks_dir, device=str(device), dtype=dtype,
                              batch_size=config.batch_size, progress=config.progress)
    if config.json_out is not None:
        write_text_atomically(config.json_out, json.dumps(results, indent=2) + "\n")
    return results


def main(config: EvalConfig) -> int:
    _print_table(run(config))
    return 0


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
