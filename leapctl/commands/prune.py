"""`leapctl prune`: one-shot magnitude, Wanda or SparseGPT pruning into a run folder."""

import typer

from leapctl.cli import app
from leapctl.prune.config import PruneConfig
from leapctl.settings import config_command


def _prune(config: PruneConfig) -> None:
    from leapctl.runs import prune_run

    report = prune_run(config)
    achieved = report["achieved_sparsity"]["global"]
    typer.echo(f"{config.method}: {len(report['achieved_sparsity']['per_layer'])} layers pruned to "
               f"{achieved:.4f} sparsity (target {config.sparsity}) in {report['prune_seconds']:.1f}s "
               f"-> {config.out}")


config_command(app, PruneConfig, _prune, name="prune",
               help="Prune MODEL one-shot and write the pruned checkpoint, its masks and a report to --out.")
