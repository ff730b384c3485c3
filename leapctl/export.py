"""`leapctl export`: turn a pruned checkpoint and its masks into files other tools load.

- `bitmap`, `csr` (and any other registered sparse format, e.g. `tiled-csl`): a Hugging Face folder whose
  config carries `quantization_config = {"quant_method": "leap_sparse", "format", "sparsity", "ignore"}`
  and whose safetensors shards store each pruned linear `X` as `X.shape` plus the format's tensors
  (`X.bitmap`, `X.values`, `X.row_offsets` for bitmap) instead of `X.weight`. This is what serving loads;
  q/k/v and gate/up stay separate because vLLM routes `q_proj.bitmap` to the `q` shard of `qkv_proj`.
- `compressed-tensors`: llm-compressor's `sparse-bitmask` layout (`X.shape`, `X.compressed`, `X.bitmask`,
  `X.row_offsets`) with the `sparsity_config` compressed-tensors describes.
- `onnx`: the masked model, dense with zeros, checked against torch with onnxruntime.

Every export has `manifest.json` (checksums, per-layer density and sizes, source, mask origin, versions)
so that `leapctl validate` and `leapctl serve` can tell an intact export from a damaged one."""

import hashlib
import json
import platform
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from leapctl import __version__
from leapctl.errors import LeapctlError
from leapctl.masks import MaskSet, load_masks
from leapctl.models import resolve_model
from leapctl.outdir import atomic_output_dir
from leapctl.runs import MASKS_FILE, mask_source, masks_file
from sparse_formats import FORMATS, get_format, nbytes

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "leapctl.export/1"
QUANT_METHOD = "leap_sparse"
COMPRESSED_TENSORS = "compressed-tensors"
ONNX = "onnx"
# compressed-tensors' names for the bitmap format's tensors
CT_NAMES = {"shape": "shape", "bitmap": "bitmask", "values": "compressed", "row_offsets": "row_offsets"}
INDEX_FILE = "model.safetensors.index.json"
# Files of a source folder that an export does not copy: weights, the config (rewritten), leapctl run files.
NOT_COPIED = re.compile(r".*\.(safetensors|bin|pt|pth|onnx|onnx\.data)$|.*\.index\.json$|"
                        r"^(config\.json|masks\.safetensors|report\.json|manifest\.json)$")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ONNX_PROMPTS = ["Once upon a time", "The little dog"]


def export_formats() -> list[str]:
    return sorted(FORMATS) + [COMPRESSED_TENSORS, ONNX]


@dataclass
class Source:
    """A checkpoint folder and the masks that prune it."""

    spec: str
    path: Path
    mask_file: Path
    mask_set: MaskSet


def resolve_source(spec: str, masks: Path | None = None) -> Source:
    """A run folder (checkpoint + its masks) or a model plus an explicit mask file (or run folder)."""
    path = resolve_model(spec)
    mask_file = mask_source(masks) if masks is not None else masks_file(path)
    if mask_file is None:
        raise LeapctlError(f"{spec} has no {MASKS_FILE}: pass --masks FILE or a run folder from prune/learn")
    return Source(spec=spec, path=path.resolve(), mask_file=mask_file.resolve(),
                  mask_set=load_masks(mask_file))


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in index order when sharded."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in dict.fromkeys(weight_map.values())]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise LeapctlError(f"{folder} has no safetensors weights (model.safetensors or {INDEX_FILE})")


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder by name; one clear error for an unreadable file."""
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(folder):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise LeapctlError(f"cannot read {file}: {exc}") from None
    return tensors


def linear_names(config) -> list[str]:
    """Qualified names of every nn.Linear in the model, found on the meta device (no weights loaded)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


def masked_weight(weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The pruned weight with +0.0 at pruned positions (multiplying would leave -0.0 behind)."""
    return torch.where(mask, weight, torch.zeros((), dtype=weight.dtype))


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", text.upper())
    if not match:
        raise LeapctlError(f"cannot read the size {text!r} (examples: 5GB, 500MB, 2GiB)")
    number, unit = float(match.group(1)), (match.group(2) or "B")
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(number * base**power)


class ShardWriter:
    """Writes tensors into safetensors shards of at most `max_bytes` (a module's tensors stay together),
    named as Hugging Face names them, with the index file when there is more than one."""

    def __init__(self, out: Path, max_bytes: int):
        self.out, self.max_bytes = out, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, group: dict[str, torch.Tensor]) -> None:
        size = nbytes(group)
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending.update({name: t.contiguous() for name, t in group.items()})
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.out / f".shard-{len(self.written)}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> dict[str, str]:
        """Rename the shards to their final names; returns the weight map."""
        self.flush()
        count = len(self.written)
        weight_map = {}
        for number, (path, names) in enumerate(self.written, start=1):
            final = "model.safetensors" if count == 1 else f"model-{number:05d}-of-{count:05d}.safetensors"
            path.rename(self.out / final)
            weight_map.update(dict.fromkeys(names, final))
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": dict(sorted(weight_map.items()))}
            (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return weight_map


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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


def export(spec: str, fmt: str, out: Path, masks: Path | None = None, overwrite: bool = False,
           max_shard_size: str = "5GB", dtype: str | None = None) -> dict:
    """Write the export of `spec` (run folder or model + `masks`) in `fmt` to `out`; returns the manifest."""
    if fmt not in export_formats():
        raise LeapctlError(f"unknown export format {fmt!r} (choose from {', '.join(export_formats())})")
    if dtype is not None and dtype not in DTYPES:
        raise LeapctlError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    max_bytes = parse_size(max_shard_size)
    source = resolve_source(spec, masks)
    with atomic_output_dir(Path(out), overwrite) as tmp:
        if fmt == ONNX:
            layers, totals, extra = _write_onnx(source, tmp, dtype)
        else:
            layers, totals, extra = _write_sparse_checkpoint(source, fmt, tmp, max_bytes, dtype)
        _copy_side_files(source.path, tmp)
        manifest = _manifest(source, fmt, tmp, layers, totals, extra, dtype)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _source_config(source: Source):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source.path)
    except Exception as exc:  # transformers raises many types for unreadable configs
        raise LeapctlError(f"cannot read the config of {source.spec}: {exc}") from None


def _write_sparse_checkpoint(source: Source, fmt: str, out: Path, max_bytes: int, dtype: str | None):
    config = _source_config(source)
    tensors = load_tensors(source.path)
    masks = source.mask_set.masks
    for name in masks:
        if name not in tensors:
            raise LeapctlError(f"the masks name {name}, which {source.spec} does not have")
    target = DTYPES[dtype] if dtype else None
    codec = get_format("bitmap" if fmt == COMPRESSED_TENSORS else fmt)
    writer = ShardWriter(out, max_bytes)
    layers = {}
    for name, tensor in tensors.items():
        if target is not None and tensor.is_floating_point():
            tensor = tensor.to(target)
        if name not in masks:
            writer.add({name: tensor})
            continue
        mask = masks[name]
        if tuple(mask.shape) != tuple(tensor.shape):
            raise LeapctlError(f"mask for {name} has shape {tuple(mask.shape)}, "
                               f"weight has {tuple(tensor.shape)}")
        try:
            encoded = codec.encode(tensor, mask)
        except ValueError as exc:
            hint = " (use --dtype float16 or bfloat16)" if "16-bit" in str(exc) else ""
            raise LeapctlError(f"cannot encode {name} as {fmt}: {exc}{hint}") from None
        layer = name.removesuffix(".weight")
        keys = CT_NAMES if fmt == COMPRESSED_TENSORS else {key: key for key in encoded}
        group = {f"{layer}.{keys[key]}": value for key, value in encoded.items()}
        writer.add(group)
        kept = int(mask.sum())
        layers[layer] = {
            "shape": list(tensor.shape),
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "kept": kept,
            "density": kept / mask.numel(),
            "dense_bytes": tensor.numel() * tensor.element_size(),
            "sparse_bytes": nbytes(encoded),
            "tensors": sorted(group),
        }
    weight_map = writer.finish()
    for info in layers.values():
        info["file"] = weight_map[info["tensors"][0]]

    dense_names = [name for name in tensors if name not in masks]
    ignore = sorted(name for name in linear_names(config) if f"{name}.weight" not in masks)
    sparsity = source.mask_set.sparsity()["global"]
    config_dict = config.to_dict()
    if dtype:
        config_dict["dtype"] = dtype
        config_dict.pop("torch_dtype", None)
    if fmt == COMPRESSED_TENSORS:
        config_dict["quantization_config"] = _compressed_tensors_config(ignore, sparsity)
    else:
        config_dict["quantization_config"] = {"quant_method": QUANT_METHOD, "format": fmt,
                                              "sparsity": sparsity, "ignore": ignore}
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    dense_other = sum(tensors[n].numel() * (target.itemsize if target and tensors[n].is_floating_point()
                                            else tensors[n].element_size()) for n in dense_names)
    totals = {
        "pruned_dense_bytes": sum(info["dense_bytes"] for info in layers.values()),
        "pruned_sparse_bytes": sum(info["sparse_bytes"] for info in layers.values()),
        "checkpoint_dense_bytes": dense_other + sum(info["dense_bytes"] for info in layers.values()),
        "checkpoint_sparse_bytes": writer.total_bytes,
    }
    return layers, totals, {"dense_tensors": sorted(dense_names), "ignore": ignore,
                            "weight_files": sorted(set(weight_map.values()))}


def _compressed_tensors_config(ignore: list[str], sparsity: float) -> dict:
    """The config compressed-tensors reads for a sparse-bitmask checkpoint."""
    sparsity_config = {"format": "sparse-bitmask", "targets": ["Linear"], "ignore": ignore,
                       "global_sparsity": sparsity, "sparsity_structure": "unstructured"}
    try:
        import compressed_tensors
        from compressed_tensors.config import BitmaskConfig

        sparsity_config = BitmaskConfig(**sparsity_config).model_dump()
        version = compressed_tensors.__version__
    except ImportError:
        version = "unknown"
    return {"quant_method": "compressed-tensors", "format": "sparse-bitmask", "version": version,
            "sparsity_config": sparsity_config}


def _copy_side_files(source: Path, out: Path) -> None:
    """Tokenizer, generation config, chat template: everything but weights, config and leapctl files."""
    for item in sorted(source.iterdir()):
        if item.is_file() and not NOT_COPIED.fullmatch(item.name) and not (out / item.name).exists():
            shutil.copy2(item, out / item.name)


def load_masked_model(path: Path, mask_set: MaskSet, dtype: torch.dtype):
    """The source model with pruned weights zeroed, in eval mode."""
    from leapctl.models import load_model

    model, tokenizer = load_model(str(path), dtype=dtype)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, mask in mask_set.masks.items():
            if name not in params:
                raise LeapctlError(f"the masks name {name}, which the model does not have")
            params[name].copy_(masked_weight(params[name], mask))
    return model, tokenizer


class _LogitsOnly(torch.nn.Module):
    """The model as ONNX sees it: token ids in, logits out, no cache."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def onnx_logits(model_file: Path, input_ids: torch.Tensor) -> torch.Tensor:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(["logits"], {"input_ids": input_ids.numpy()})[0])


def sample_ids(tokenizer, prompts: list[str]) -> torch.Tensor:
    """One batch of equally long prompts (truncated to the shortest) so that no padding is needed."""
    encoded = [tokenizer(p, return_tensors="pt").input_ids[0] for p in prompts]
    length = min(len(e) for e in encoded)
    return torch.stack([e[:length] for e in encoded])


def _write_onnx(source: Source, out: Path, dtype: str | None):
    try:
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise LeapctlError(f"onnx export needs onnxruntime and onnxscript ({exc})") from None
    model, tokenizer = load_masked_model(source.path, source.mask_set, DTYPES[dtype or "float32"])
    wrapper = _LogitsOnly(model).eval()
    input_ids = sample_ids(tokenizer, ONNX_PROMPTS)
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("sequence", min=2, max=4096)
    model_file = out / "model.onnx"
    try:
        with torch.no_grad():
            program = torch.onnx.export(wrapper, (input_ids,), dynamo=True, input_names=["input_ids"],
                                        output_names=["logits"],
                                        dynamic_shapes={"input_ids": {0: batch, 1: seq}}, verbose=False)
        program.save(str(model_file), external_data=True)
    except Exception as exc:  # the exporter raises many types; the user needs one line
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise LeapctlError(f"torch.onnx.export failed for {source.spec}: {reason}") from None
    with torch.no_grad():
        expected = wrapper(input_ids).float()
    got = onnx_logits(model_file, input_ids).float()
    difference = float((got - expected).abs().max())
    tolerance = 1e-3 * max(1.0, float(expected.abs().max()))
    if difference > tolerance:
        raise LeapctlError(f"onnxruntime logits differ from torch by {difference:.3g} (> {tolerance:.3g})")
    model.config.to_json_file(out / "config.json")
    layers = {}
    for name, mask in source.mask_set.masks.items():
        weight = dict(model.named_parameters())[name]
        kept = int(mask.sum())
        size = weight.numel() * weight.element_size()
        layers[name.removesuffix(".weight")] = {"shape": list(weight.shape), "dtype": str(weight.dtype)[6:],
                                                "kept": kept, "density": kept / mask.numel(),
                                                "dense_bytes": size, "sparse_bytes": size}
    pruned = sum(info["dense_bytes"] for info in layers.values())
    totals = {"pruned_dense_bytes": pruned, "pruned_sparse_bytes": pruned}
    return layers, totals, {"onnx_check": {"prompts": ONNX_PROMPTS, "max_abs_logit_diff": difference,
                                           "tolerance": tolerance}}


def _manifest(source: Source, fmt: str, out: Path, layers: dict, totals: dict, extra: dict,
              dtype: str | None) -> dict:
    files = {}
    for path in sorted(out.rglob("*")):
        if path.is_file() and path.name != MANIFEST_FILE:
            files[str(path.relative_to(out))] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    totals = {**totals, "files_bytes": sum(f["bytes"] for f in files.values())}
    if totals.get("pruned_sparse_bytes"):
        totals["pruned_compression"] = totals["pruned_dense_bytes"] / totals["pruned_sparse_bytes"]
    return {
        "manifest_format": MANIFEST_FORMAT,
        "format": fmt,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": {"spec": source.spec, "path": str(source.path), "model": source.mask_set.model},
        "masks": {"file": str(source.mask_file), "sha256": sha256_file(source.mask_file),
                  "origin": source.mask_set.extra},
        "dtype": dtype,
        "sparsity": source.mask_set.sparsity()["global"],
        "files": files,
        "layers": layers,
        "totals": totals,
        **extra,
        "versions": versions(),
    }
