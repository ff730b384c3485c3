"""`leapctl learn MODEL --sparsity S --out RUN`: LEAP mask learning into a run folder (same layout as
`leapctl prune`). From Python: `run(LearnConfig(...))` returns a `LearnResult`; `leapctl.learn.leap_masks`
learns a mask in memory.

Under `torchrun --nproc-per-node N -m leapctl learn ...` it runs data parallel (DDP; `--fsdp` for FSDP2)."""

import json

import typer

from leapctl.learn.config import LearnConfig

NAME = "learn"
HELP = ("Learn a LEAP mask for MODEL at --sparsity and write the pruned checkpoint, masks, report and plots "
        "to --out.")
Config = LearnConfig


def run(config: LearnConfig):
    """Load, learn, write the run folder (rank 0); returns a `LearnResult`."""
    from leapctl.learn import learn_masks

    return learn_masks(config)


def main(config: LearnConfig) -> int:
    result = run(config)
    if result.interrupted_by:
        typer.echo(f"interrupted after step {result.steps_done}: checkpoint in {result.state_dir}; "
                   f"rerun with --resume to continue", err=True)
        return 128 + result.interrupted_by
    if result.out is not None:
        report = json.loads((result.out / "report.json").read_text())
        peak = report["peak_memory"]
        peak_bytes = peak.get("cuda_max_allocated_bytes", peak["process_max_rss_bytes"])
        typer.echo(f"wrote {result.out}: sparsity {report['achieved_sparsity']['global']:.4f}, final LM loss "
                   f"{report['final'].get('lm_loss', float('nan')):.4f}, "
                   f"{report['tokens_per_s'] or 0:.0f} tokens/s, peak memory {peak_bytes / 2**20:.0f} MiB")
    return 0
