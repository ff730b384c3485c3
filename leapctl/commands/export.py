"""`leapctl export`: a pruned run (or a model plus masks) written by one of the registered export targets
(`leapctl.exporters`), with `manifest.json` (checksums, per-layer density and sizes, source, mask origin,
versions; `leapctl.exporters.manifest`) so that `leapctl validate` and `leapctl serve` can tell an intact
export from a damaged one.

Exports are Hugging Face folders: tokenizer, generation config and chat template are copied; weights and
leapctl's own run files are not."""

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from leapctl.settings import setting

NAME = "export"
HELP = "Export SOURCE in --format to --out, with manifest.json (checksums, per-layer density and sizes)."

# Files of a source folder that an export does not copy: weights, the config (rewritten), leapctl run files.
NOT_COPIED = re.compile(r".*\.(safetensors|bin|pt|pth|onnx|onnx\.data)$|.*\.index\.json$|"
                        r"^(config\.json|masks\.safetensors|report\.json|manifest\.json|metrics\.jsonl)$")


@dataclass
class ExportConfig:
    source: str = setting(help="Run folder from prune/learn, or a model folder with --masks.", argument=True,
                          metavar="SOURCE")
    format: str = setting(help="bitmap or csr (serving checkpoints), tiled-csl, tiled-bitmap, bitmap-q4, "
                               "compressed-tensors or onnx.")
    out: Path = setting(help="Output folder (written atomically).")
    masks: Path | None = setting(None, "Mask file or run folder; default: the masks of SOURCE.")
    dtype: str | None = setting(None, "Cast weights first: float32, float16 or bfloat16. Default: keep the "
                                      "source dtype, or the one the format needs (tiled-csl: float16).")
    max_shard_size: str = setting("5GB", "Largest safetensors shard, e.g. 2GB.")
    overwrite: bool = setting(False, "Replace a non-empty output folder.", flag="--overwrite")


Config = ExportConfig


def run(config: ExportConfig, notify: Callable[[str], None] | None = None) -> dict:
    """Write the export; returns the manifest."""
    return export(config.source, config.format, config.out, masks=config.masks, overwrite=config.overwrite,
                  max_shard_size=config.max_shard_size, dtype=config.dtype, notify=notify)


def main(config: ExportConfig) -> int:
    """The command: `run` under a spinner, then one line of sizes."""
    from rich.console import Console

    from leapctl.outdir import check_output_dir

    check_output_dir(config.out, config.overwrite, (config.source, config.masks))
    console = Console(stderr=True)
    with console.status(f"exporting {config.source} as {config.format}"):
        manifest = run(config, notify=console.print)
    totals = manifest["totals"]
    console.print(f"wrote {config.out}: {config.format}, {len(manifest['layers'])} pruned layers at sparsity "
                  f"{manifest['sparsity']:.1%}; pruned layers {totals['pruned_sparse_bytes'] / 1e6:.2f} MB "
                  f"(dense {totals['pruned_dense_bytes'] / 1e6:.2f} MB); "
                  f"files {totals['files_bytes'] / 1e6:.2f} MB")
    return 0


def export(spec: str, fmt: str, out: Path, masks: Path | None = None, overwrite: bool = False,
           max_shard_size: str = "5GB", dtype: str | None = None,
           notify: Callable[[str], None] | None = None) -> dict:
    """Write the export of `spec` (run folder, or model + `masks`) in `fmt` to `out`; returns the manifest.
    A format that cannot hold the source's dtype gets a cast, which `notify` hears about in one line."""
    from leapctl.compute import dtype_from_name
    from leapctl.exporters import get_exporter
    from leapctl.exporters.base import MANIFEST_FILE, ExportOptions, parse_size, pruned_dtype
    from leapctl.exporters.manifest import build_manifest
    from leapctl.outdir import atomic_output_dir
    from leapctl.runs import read_run

    exporter = get_exporter(fmt)
    requested = dtype_from_name(dtype) if dtype is not None else None
    max_bytes = parse_size(max_shard_size)
    source = read_run(spec, masks)
    exporter.check_source(source)
    cast, reason = exporter.cast_for(pruned_dtype(source), requested)
    if reason and notify is not None:
        notify(reason)
    with atomic_output_dir(Path(out), overwrite, (source.path, source.masks_file)) as tmp:
        written = exporter.write(source, tmp, ExportOptions(max_shard_bytes=max_bytes, dtype=cast))
        _copy_side_files(source.path, tmp)
        manifest = build_manifest(source, fmt, tmp, written, cast, reason)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _copy_side_files(source: Path, out: Path) -> None:
    """Tokenizer, generation config, chat template: everything but weights, config and leapctl files."""
    for item in sorted(source.iterdir()):
        if item.is_file() and not NOT_COPIED.fullmatch(item.name) and not (out / item.name).exists():
            shutil.copy2(item, out / item.name)
