"""`leapctl eval`: perplexity and zero-shot accuracy of several models side by side."""

import json
import os
from pathlib import Path

import typer

from leapctl.cli import app
from leapctl.errors import LeapctlError

DTYPES = ("float32", "bfloat16", "float16")


@app.command("eval")
def eval_models(
    models: list[str] = typer.Argument(..., metavar="MODEL",
                                       help="Local HF folders (run folders of prune/learn), hub ids or "
                                            "built-in names; evaluated one after another."),
    ppl: list[str] = typer.Option([], "--ppl", help="Perplexity text: a file (repeatable) or 'wikitext2' "
                                                   "(WikiText-2 test from the shared assets). Default: "
                                                   "wikitext2 when no --tasks are given."),
    seq_len: int | None = typer.Option(None, "--seq-len", help="Perplexity window; default the model's "
                                                                "context capped at 4096."),
    tasks: str = typer.Option("", "--tasks", help="Zero-shot tasks, comma-separated: "
                                                  "piqa,winogrande,hellaswag."),
    limit: int | None = typer.Option(None, "--limit", help="Only the first N items of each task."),
    tasks_dir: Path | None = typer.Option(None, "--tasks-dir", help="Folder with piqa/, winogrande/, "
                                                                    "hellaswag/; default the shared assets."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON here."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    batch_size: int = typer.Option(1, "--batch-size", help="Perplexity windows per forward pass."),
) -> None:
    """Perplexity (non-overlapping windows, as the pruning papers measure WikiText-2) and zero-shot
    accuracy (lm-eval acc / acc_norm) of each MODEL, printed as a table, optionally saved as JSON."""
    import torch

    from leapctl.eval import evaluate_models, load_ppl_text, parse_tasks

    if dtype not in DTYPES:
        raise LeapctlError(f"unknown --dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if device not in ("auto", "cpu") and not device.startswith("cuda"):
        raise LeapctlError(f"unknown --device {device!r} (auto, cpu or cuda)")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise LeapctlError("--device cuda, but no CUDA device is available")
    task_names = parse_tasks(tasks)
    texts = [load_ppl_text(spec) for spec in (ppl or ([] if task_names else ["wikitext2"]))]
    if json_out is not None and json_out.is_dir():
        raise LeapctlError(f"--json {json_out} is a folder")

    results = evaluate_models(models, texts, task_names, seq_len=seq_len, limit=limit, tasks_dir=tasks_dir,
                              device=device, dtype=getattr(torch, dtype), batch_size=batch_size)
    if json_out is not None:
        _write_json_atomically(json_out, results)
    _print_table(results)


def _write_json_atomically(path: Path, results: dict) -> None:
    """Write beside the target and rename, so an interrupted run leaves no half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(partial, path)


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
