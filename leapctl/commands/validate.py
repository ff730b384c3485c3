"""`leapctl validate`: check an export's files, layers, serving op and end-to-end outputs against its
source."""

from pathlib import Path

import typer

from leapctl.cli import app


@app.command()
def validate(
    export_dir: Path = typer.Argument(..., help="Folder written by `leapctl export`."),
    reference: str | None = typer.Option(None, "--reference",
                                         help="Run folder or model to compare with (default: the source "
                                              "recorded in manifest.json when it is a local folder; a hub "
                                              "id is fetched only when named here)."),
    max_new_tokens: int = typer.Option(12, "--max-new-tokens", help="Greedy tokens generated per prompt."),
    end_to_end: bool = typer.Option(True, "--end-to-end/--no-end-to-end",
                                    help="Compare logits and greedy generations with the reference model."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="One row per check instead of a summary."),
) -> None:
    """Validate EXPORT_DIR; exit status 1 if any check fails (the table names the file or tensor)."""
    from rich.console import Console
    from rich.table import Table

    from leapctl.validate import validate as run_validate

    console = Console()
    if not console.is_terminal:  # piped or logged: keep tensor names on one greppable line
        console = Console(width=200)
    with console.status(f"validating {export_dir}"):
        report = run_validate(export_dir, reference=reference, max_new_tokens=max_new_tokens,
                              end_to_end=end_to_end)
    table = Table(title=f"{export_dir} ({report.fmt})")
    for column in ("check", "target", "result", "detail"):
        table.add_column(column, overflow="fold")
    kinds = list(dict.fromkeys(c.kind for c in report.checks))
    for kind in kinds:
        checks = [c for c in report.checks if c.kind == kind]
        passed = [c for c in checks if c.ok]
        for check in checks:
            if verbose or not check.ok:
                result = {False: "[red]FAIL[/red]", True: "[green]ok[/green]", None: "skip"}[check.ok]
                table.add_row(kind, check.target, result, check.detail)
        if passed and not verbose:
            target = passed[0].target if len(passed) == 1 else f"{len(passed)} of {len(checks)}"
            table.add_row(kind, target, "[green]ok[/green]", passed[0].detail if len(passed) == 1 else "")
    console.print(table)
    if any(c.kind == "reference" for c in report.failures):
        console.print("[red]nothing was compared with the source model: the export's own consistency is "
                      "all that was checked[/red]")
    if report.failures:
        console.print(f"[red]{len(report.failures)} check(s) failed[/red]")
        raise typer.Exit(1)
    skipped = [c for c in report.checks if c.ok is None and c.detail != "not requested"]
    console.print("[green]all checks passed[/green]" + (f" ({len(skipped)} skipped)" if skipped else ""))
