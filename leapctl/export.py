"""`leapctl export`: a pruned run (or a model plus masks) written by one of the registered export targets
(`leapctl.exporters`), with `manifest.json` (checksums, per-layer density and sizes, source, mask origin,
versions) so that `leapctl validate` and `leapctl serve` can tell an intact export from a damaged one.

Exports are Hugging Face folders: tokenizer, generation config and chat template are copied; weights and
leapctl's own run files are not."""

import json
import platform
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from leapctl import __version__
from leapctl.compute import dtype_from_name, dtype_name
from leapctl.exporters import exporter_names, get_exporter
from leapctl.exporters.base import (
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    ExportOptions,
    Written,
    parse_size,
    pruned_dtype,
    sha256_file,
)
from leapctl.outdir import atomic_output_dir
from leapctl.runs import Run, read_run

# Files of a source folder that an export does not copy: weights, the config (rewritten), leapctl run files.
NOT_COPIED = re.compile(r".*\.(safetensors|bin|pt|pth|onnx|onnx\.data)$|.*\.index\.json$|"
                        r"^(config\.json|masks\.safetensors|report\.json|manifest\.json|metrics\.jsonl)$")


def export(spec: str, fmt: str, out: Path, masks: Path | None = None, overwrite: bool = False,
           max_shard_size: str = "5GB", dtype: str | None = None,
           notify: Callable[[str], None] | None = None) -> dict:
    """Write the export of `spec` (run folder, or model + `masks`) in `fmt` to `out`; returns the manifest.
    A format that cannot hold the source's dtype gets a cast, which `notify` hears about in one line."""
    exporter = get_exporter(fmt)
    requested = dtype_from_name(dtype) if dtype is not None else None
    max_bytes = parse_size(max_shard_size)
    source = read_run(spec, masks)
    exporter.check_source(source)
    cast, reason = exporter.cast_for(pruned_dtype(source), requested)
    if reason and notify is not None:
        notify(reason)
    with atomic_output_dir(Path(out), overwrite) as tmp:
        written = exporter.write(source, tmp, ExportOptions(max_shard_bytes=max_bytes, dtype=cast))
        _copy_side_files(source.path, tmp)
        manifest = _manifest(source, fmt, tmp, written, cast, reason)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _copy_side_files(source: Path, out: Path) -> None:
    """Tokenizer, generation config, chat template: everything but weights, config and leapctl files."""
    for item in sorted(source.iterdir()):
        if item.is_file() and not NOT_COPIED.fullmatch(item.name) and not (out / item.name).exists():
            shutil.copy2(item, out / item.name)


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


def _manifest(source: Run, fmt: str, out: Path, written: Written, cast: torch.dtype | None,
              reason: str) -> dict:
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


__all__ = ["export", "exporter_names"]
