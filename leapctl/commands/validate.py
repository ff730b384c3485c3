"""`leapctl validate EXPORT_DIR`: prove that an export is intact and equals the pruned model it came from.

Checks, each reported per file or per tensor so that a failure names what is wrong:
1. files: every file in manifest.json exists with its size and sha256, and nothing unlisted sits beside them;
2. reference: the source model and masks the export is compared with (the manifest's source, or
   `--reference`); without one nothing can be compared, and that is a failure, not a pass;
3. the export target's own checks (`leapctl.exporters`): for sparse checkpoints, tensors (every shard reads,
   the index is right, nothing unexpected), format (each layer's encoding is consistent), decode (each
   layer decodes bit for bit to the reference weight with the reference mask applied; dense tensors are
   identical), sparse-linear (serving's op, for servable formats), logits and generate (a dense model rebuilt
   from the export against the reference); for ONNX, the masked weights among its constants and
   onnxruntime's logits."""

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from leapctl.errors import LeapctlError
from leapctl.settings import setting

if TYPE_CHECKING:
    from leapctl.exporters.base import Report

NAME = "validate"
HELP = "Validate EXPORT_DIR; exit status 1 if any check fails (the table names the file or tensor)."


@dataclass
class ValidateConfig:
    export_dir: Path = setting(help="Folder written by `leapctl export`.", argument=True,
                               metavar="EXPORT_DIR")
    reference: str | None = setting(None, "Run folder or model to compare with (default: the source recorded "
                                          "in manifest.json when it is a local folder; a hub id is fetched "
                                          "only when named here).")
    max_new_tokens: int = setting(12, "Greedy tokens generated per prompt.", min=1)
    end_to_end: bool = setting(True, "Compare logits and greedy generations with the reference model.")
    verbose: bool = setting(False, "One row per check instead of a summary.", flag=("--verbose", "-v"))


Config = ValidateConfig


def run(config: ValidateConfig) -> "Report":
    """Run the checks; returns the `Report` (`report.failures` lists what failed)."""
    return validate(config.export_dir, reference=config.reference, max_new_tokens=config.max_new_tokens,
                    end_to_end=config.end_to_end)


def main(config: ValidateConfig) -> int:
    """The command: `run` under a spinner, then the table of checks; 1 if any failed."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # piped or logged: keep tensor names on one greppable line
        console = Console(width=200)
    with console.status(f"validating {config.export_dir}"):
        report = run(config)
    console.print(_table(report, config.verbose))
    if any(c.kind == "reference" for c in report.failures):
        console.print("[red]nothing was compared with the source model: the export's own consistency is "
                      "all that was checked[/red]")
    if report.failures:
        console.print(f"[red]{len(report.failures)} check(s) failed[/red]")
        return 1
    skipped = [c for c in report.checks if c.ok is None and c.detail != "not requested"]
    console.print("[green]all checks passed[/green]" + (f" ({len(skipped)} skipped)" if skipped else ""))
    return 0


def _table(report: "Report", verbose: bool):
    """Failures one row each; passed checks one summary row per kind (every row with --verbose)."""
    from rich.table import Table

    table = Table(title=f"{report.export_dir} ({report.fmt})")
    for column in ("check", "target", "result", "detail"):
        table.add_column(column, overflow="fold")
    for kind in dict.fromkeys(c.kind for c in report.checks):
        checks = [c for c in report.checks if c.kind == kind]
        passed = [c for c in checks if c.ok]
        for check in checks:
            if verbose or not check.ok:
                result = {False: "[red]FAIL[/red]", True: "[green]ok[/green]", None: "skip"}[check.ok]
                table.add_row(kind, check.target, result, check.detail)
        if passed and not verbose:
            target = passed[0].target if len(passed) == 1 else f"{len(passed)} of {len(checks)}"
            table.add_row(kind, target, "[green]ok[/green]", passed[0].detail if len(passed) == 1 else "")
    return table


def validate(export_dir: Path, reference: str | None = None, prompts: list[str] | None = None,
             max_new_tokens: int = 12, seed: int = 0, end_to_end: bool = True) -> "Report":
    """Run the checks on `export_dir` (all of them unless `end_to_end` is False, which skips logits and
    generations); the report lists each result (see the module docstring)."""
    from leapctl.exporters import get_exporter
    from leapctl.exporters.base import PROMPTS, Report, ValidateOptions
    from leapctl.exporters.manifest import check_files, read_manifest

    export_dir = Path(export_dir)
    manifest = read_manifest(export_dir)
    exporter = get_exporter(manifest["format"])
    report = Report(export_dir, manifest["format"])
    check_files(export_dir, manifest, report)
    ref = _reference(manifest, reference, report)
    options = ValidateOptions(end_to_end=end_to_end, prompts=prompts or list(PROMPTS),
                              max_new_tokens=max_new_tokens, seed=seed)
    exporter.check(export_dir, manifest, ref, report, options)
    return report


def _reference(manifest: dict, reference: str | None, report):
    """The source model and its masks: `reference` when given (a run folder, or any MODEL spec, which may be
    fetched from the hub because it was asked for), else the manifest's source only where it is a local
    folder, so that validate makes no network call of its own. The source may lack its masks (a model
    exported with `--masks FILE`): then the recorded mask file is used. Without a reference nothing can be
    compared, which is reported as a failure."""
    spec = reference or manifest["source"]["path"]
    if reference is None and not Path(spec).is_dir():
        report.add("reference", spec, False, "the recorded source is not a local folder here; nothing was "
                                             "compared with the source model: pass --reference RUN_OR_MODEL")
        return None
    from leapctl.compute import dtype_from_name
    from leapctl.exporters.base import Reference, load_tensors
    from leapctl.runs import read_run

    try:
        run = read_run(spec)
    except LeapctlError as exc:
        mask_file = Path(manifest["masks"]["file"])
        if not mask_file.is_file():
            report.add("reference", spec, False, f"{exc}; nothing was compared with the source model: pass "
                                                 f"--reference RUN_OR_MODEL")
            return None
        run = read_run(spec, masks=mask_file)
        spec = f"{spec} + {mask_file}"
    dtype = manifest.get("dtype")
    report.add("reference", spec, True, "masks from " + ("the reference run" if reference else "the source"))
    return Reference(spec, run, dtype_from_name(dtype) if dtype else None, load_tensors(run.path))
