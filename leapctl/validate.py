"""`leapctl validate`: prove that an export is intact and equals the pruned model it came from.

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

import json
from pathlib import Path

from leapctl.errors import LeapctlError
from leapctl.exporters import get_exporter
from leapctl.exporters.base import (
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    PROMPTS,
    Reference,
    Report,
    ValidateOptions,
    load_tensors,
    sha256_file,
)
from leapctl.runs import read_run

__all__ = ["PROMPTS", "Report", "check_files", "read_manifest", "validate"]


def read_manifest(export_dir: Path) -> dict:
    """The export's manifest, refused in one line unless every file name it lists is a plain relative name
    inside the folder (a manifest is data: `../x` or `/etc/x` must never be opened on its say-so)."""
    path = Path(export_dir) / MANIFEST_FILE
    if not path.is_file():
        raise LeapctlError(f"{export_dir} has no {MANIFEST_FILE}; is it a folder written by "
                           f"`leapctl export`?")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LeapctlError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("manifest_format") != MANIFEST_FORMAT:
        found = manifest.get("manifest_format") if isinstance(manifest, dict) else type(manifest).__name__
        raise LeapctlError(f"{path} is not a leapctl export manifest ({found!r})")
    files, weight_files = manifest.get("files"), manifest.get("weight_files", [])
    if not isinstance(files, dict) or not isinstance(weight_files, list):
        raise LeapctlError(f"{path} is not a leapctl export manifest (no list of files)")
    for name in [*files, *weight_files]:
        if not plain_name(name):
            raise LeapctlError(f"{path} lists the file {name!r}, which is not a plain relative name inside "
                               f"the folder; refusing to open it")
    return manifest


def plain_name(name: object) -> bool:
    """A relative path of plain parts (no `..`, `.`, empty part, backslash or NUL): it stays in the folder."""
    return (isinstance(name, str) and bool(name) and "\\" not in name and "\0" not in name
            and not name.startswith("/") and all(part not in ("", ".", "..") for part in name.split("/")))


def validate(export_dir: Path, reference: str | None = None, prompts: list[str] | None = None,
             max_new_tokens: int = 12, seed: int = 0, end_to_end: bool = True) -> Report:
    """Run the checks on `export_dir` (all of them unless `end_to_end` is False, which skips logits and
    generations); the report lists each result (see the module docstring)."""
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


def check_files(export_dir: Path, manifest: dict, report: Report) -> None:
    listed = manifest["files"]
    for name, info in listed.items():
        path = export_dir / name
        if path.is_symlink() or export_dir.resolve() not in path.resolve().parents:
            report.add("files", name, False, "a link (leapctl writes none; it is not followed)")
        elif not path.is_file():
            report.add("files", name, False, "missing")
        elif path.stat().st_size != info["bytes"]:
            report.add("files", name, False, f"{path.stat().st_size} bytes, manifest says {info['bytes']} "
                                             f"(truncated or extended)")
        elif sha256_file(path) != info["sha256"]:
            report.add("files", name, False, "sha256 differs from the manifest (content changed)")
        else:
            report.add("files", name, True, f"{info['bytes']} bytes, sha256 ok")
    for path in sorted(export_dir.rglob("*")):
        name = str(path.relative_to(export_dir))
        if path.is_file() and name != MANIFEST_FILE and name not in listed:
            report.add("files", name, False, "not listed in the manifest")


def _reference(manifest: dict, reference: str | None, report: Report) -> Reference | None:
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
    from leapctl.compute import dtype_from_name

    return Reference(spec, run, dtype_from_name(dtype) if dtype else None, load_tensors(run.path))
