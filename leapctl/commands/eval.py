"""`leapctl eval`: perplexity and zero-shot accuracy of several models side by side."""

from pathlib import Path

from leapctl.cli import app
from leapctl.eval.config import EvalConfig
from leapctl.settings import config_command


def _eval(config: EvalConfig) -> None:
    from leapctl.eval import run_eval

    _print_table(run_eval(config))


config_command(app, EvalConfig, _eval, name="eval",
               help="Perplexity (non-overlapping windows, as the pruning papers measure WikiText-2) and "
                    "zero-shot accuracy (lm-eval acc / acc_norm) of each MODEL, printed as a table, "
                    "optionally saved as JSON.")


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
