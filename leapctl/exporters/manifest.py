"""`manifest.json`, the one record of an export folder: written by `leapctl export`, read and checked by
`leapctl validate` and `leapctl serve` (both call `read_manifest` and `check_files` here, so the two agree
on what an intact export is).

The manifest lists every file with its size and sha256, the per-layer sizes and density, the source, the
mask origin and the tool versions."""

import json
import platform
import time
from pathlib import Path

import torch

from leapctl import __version__
from leapctl.compute import dtype_name
from leapctl.errors import LeapctlError
from leapctl.exporters.base import EXPORTERS, MANIFEST_FILE, MANIFEST_FORMAT, Report, Written, sha256_file
from leapctl.runs import Run


def versions() -> dict[str, str]:
    import safetensors
    import transformers

    found = {"leapctl": __version__, "python": platform.python_version(), "torch": torch.__version__,
             "transformers": transformers.__version__, "safetensors": safetensors.__version__}
    for module in ("compressed_tensors", "onnx", "onnxruntime"):
        try:
            found[module] = __import__(module).__version__
        except ImportError:
            continue
    return found


def build_manifest(source: Run, fmt: str, out: Path, written: Written, cast: torch.dtype | None,
                   reason: str) -> dict:
    """The manifest of the export being written in `out` (every file there is listed)."""
    files = {}
    for path in sorted(out.rglob("*")):
        if path.is_file() and path.name != MANIFEST_FILE:
            files[str(path.relative_to(out))] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    totals = {**written.totals, "files_bytes": sum(f["bytes"] for f in files.values())}
    if totals.get("pruned_sparse_bytes"):
        totals["pruned_compression"] = totals["pruned_dense_bytes"] / totals["pruned_sparse_bytes"]
    return {
        "manifest_format": MANIFEST_FORMAT,
        "format": fmt,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": {"spec": source.spec, "path": str(source.path), "model": source.masks.model},
        "masks": {"file": str(source.masks_file), "sha256": sha256_file(source.masks_file),
                  "origin": source.masks.extra},
        "dtype": dtype_name(cast) if cast is not None else None,
        "dtype_cast_reason": reason or None,
        "sparsity": source.masks.sparsity()["global"],
        "files": files,
        "layers": written.layers,
        "totals": totals,
        **written.extra,
        "versions": versions(),
    }


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
    problem = _structure_problem(manifest)
    if problem:
        raise LeapctlError(f"{path} is damaged: {problem}")
    return manifest


def _structure_problem(manifest: dict) -> str:
    """What keeps validate and serve from reading the manifest ('' when nothing): an entry missing or of the
    wrong type, at the top, in a listed file or in a layer; the lists the format's exporter reads."""
    kinds = {"format": str, "source": dict, "masks": dict, "files": dict, "layers": dict}
    exporter = EXPORTERS.get(manifest.get("format"))  # an unknown format is named by get_exporter
    kinds |= dict.fromkeys(exporter.manifest_lists if exporter is not None else (), list)
    for key, kind in kinds.items():
        if not isinstance(manifest.get(key), kind):
            return f"{key!r} is {_what(manifest.get(key))}, not a JSON {_JSON_KIND[kind]}"
    for key, inner in (("source", "path"), ("masks", "file")):
        if not isinstance(manifest[key].get(inner), str):
            return f"{key!r} names no {inner}"
    for name, info in manifest["files"].items():
        if not (isinstance(info, dict) and isinstance(info.get("sha256"), str) and _count(info.get("bytes"))):
            return f"the entry of file {name!r} is {_what(info)}, not {{\"sha256\": ..., \"bytes\": ...}}"
    tensors_listed = exporter is None or exporter.layer_tensors
    for layer, info in manifest["layers"].items():
        if not (isinstance(info, dict) and (_strings(info.get("tensors")) or not tensors_listed)
                and isinstance(info.get("shape"), list) and len(info["shape"]) == 2
                and all(_count(n) for n in info["shape"])
                and isinstance(info.get("density", 0), int | float)):
            return f"the entry of layer {layer!r} lacks its tensors, shape [rows, cols] or density"
    for key in exporter.manifest_lists if exporter is not None else ():
        if not _strings(manifest[key]):
            return f"{key!r} is not a list of names"
    return ""


_JSON_KIND = {str: "string", dict: "object", list: "list"}


def _what(value: object) -> str:
    return "missing" if value is None else f"a {type(value).__name__}"


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def plain_name(name: object) -> bool:
    """A relative path of plain parts (no `..`, `.`, empty part, backslash or NUL): it stays in the folder."""
    return (isinstance(name, str) and bool(name) and "\\" not in name and "\0" not in name
            and not name.startswith("/") and all(part not in ("", ".", "..") for part in name.split("/")))


def check_files(export_dir: Path, manifest: dict, report: Report) -> None:
    """Every listed file present with its size and sha256, never a link, and nothing unlisted beside them."""
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


def verify_manifest(export_dir: Path) -> dict:
    """`read_manifest` and `check_files` with the first problem as the error; returns the manifest."""
    export_dir = Path(export_dir)
    manifest = read_manifest(export_dir)
    report = Report(export_dir, manifest.get("format", ""))
    check_files(export_dir, manifest, report)
    if report.failures:
        first = report.failures[0]
        more = f" (and {len(report.failures) - 1} more problems)" if len(report.failures) > 1 else ""
        raise LeapctlError(f"{export_dir} fails its manifest check: {first.target}: {first.detail}{more}; "
                           f"run `leapctl validate {export_dir}` for details")
    return manifest
