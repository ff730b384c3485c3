"""`leapctl compress MODEL --sparsity S --out DIR`: the measured best pipeline (Wanda, recovery of the kept
weights, 4-bit quantization) at a budget that fits the machine, in one resumable command. From Python:
`run(CompressConfig(...))` returns the summary; `leapctl.compress.compress` is the same call."""

import typer

from leapctl.compress.config import CompressConfig

NAME = "compress"
HELP = ("Compress MODEL to --sparsity with the measured best pipeline (prune, recover, quantize) within "
        "--budget, and write a quantized run folder ready for export --format bitmap-q4; a rerun continues "
        "after the last finished stage.")
Config = CompressConfig


def run(config: CompressConfig) -> dict:
    from leapctl.compress.pipeline import compress

    return compress(config, echo=lambda line: typer.echo(line, err=True))


def main(config: CompressConfig) -> int:
    from leapctl.compress.pipeline import StageFailed

    try:
        summary = run(config)
    except StageFailed as failed:
        typer.echo(f"error: {failed}", err=True)
        return failed.status
    typer.echo(summary_table(summary, config))
    return 0


def summary_table(summary: dict, config: CompressConfig) -> str:
    """The end-of-run table: perplexity dense against compressed per text, bytes per weight, next commands."""
    lines = ["", "| text | tokens | dense | compressed | x dense |", "| --- | --- | --- | --- | --- |"]
    for row in summary["evaluation"]:
        lines.append(f"| {row['text']} | {row['tokens']:,} | {row['dense']:.2f} | {row['compressed']:.2f} | "
                     f"{row['ratio']:.3f} |")
    per_weight = summary["bytes_per_weight"]["per_weight"]
    lines += ["", f"bytes read per decoded token, per weight (matrices + lm_head): {per_weight:.3f} "
                  f"(dense fp16: 2.0; {summary['export_format']} export)",
              "next:", f"  leapctl export {config.out} --format {summary['export_format']} --out EXPORT",
              "  leapctl validate EXPORT", "  leapctl serve EXPORT"]
    return "\n".join(lines)
