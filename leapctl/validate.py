"""`leapctl validate`: prove that an export is intact and equals the pruned model it came from.

Checks, each reported per file or per tensor so that a failure names what is wrong:
1. files: every file in manifest.json exists with its size and sha256, and nothing unlisted sits beside them;
2. tensors: every shard reads, every tensor the manifest and index name is present, nothing unexpected;
3. format: each pruned layer passes its format's `check()`;
4. decode: each layer decodes bit for bit to the reference weight with the reference mask applied, and
   every dense tensor equals the reference's;
5. sparse-linear: serving's CPU ops on each layer match the dense masked matmul: the per-call decode op
   `bitmap_linear` and the native kernel on every instruction set this CPU runs (AVX-512, AVX2);
6. logits and generate: a dense model rebuilt from the decoded export gives the reference's logits and
   greedy generations on a few prompts (ONNX exports: onnxruntime's logits).
The reference is the source recorded in the manifest, or `--reference`."""

import json
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from leapctl.errors import LeapctlError
from leapctl.export import (
    COMPRESSED_TENSORS,
    CT_NAMES,
    DTYPES,
    INDEX_FILE,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    ONNX,
    load_masked_model,
    load_tensors,
    masked_weight,
    onnx_logits,
    resolve_source,
    sample_ids,
    sha256_file,
)
from leapctl.masks import MaskSet, load_masks
from sparse_formats import FormatError, get_format

PROMPTS = ["Once upon a time", "The little dog", "One day, a girl named Lily"]
# (rtol, atol relative to the output's scale) for comparing a matmul done two ways in one dtype
MATMUL_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
SERVED_FORMATS = ("bitmap", "csr", COMPRESSED_TENSORS)


@dataclass
class Check:
    kind: str
    target: str
    ok: bool | None  # None: skipped
    detail: str = ""


@dataclass
class Report:
    export_dir: Path
    fmt: str
    checks: list[Check] = field(default_factory=list)

    def add(self, kind: str, target: str, ok: bool | None, detail: str = "") -> None:
        self.checks.append(Check(kind, target, ok, detail))

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.ok is False]


def read_manifest(export_dir: Path) -> dict:
    path = Path(export_dir) / MANIFEST_FILE
    if not path.is_file():
        raise LeapctlError(f"{export_dir} has no {MANIFEST_FILE}; is it a folder written by "
                           f"`leapctl export`?")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LeapctlError(f"{path} is not valid JSON: {exc}") from None
    if manifest.get("manifest_format") != MANIFEST_FORMAT:
        raise LeapctlError(f"{path} is not a leapctl export manifest ({manifest.get('manifest_format')!r})")
    return manifest


def validate(export_dir: Path, reference: str | None = None, prompts: list[str] | None = None,
             max_new_tokens: int = 12, seed: int = 0, end_to_end: bool = True) -> Report:
    """Run the checks on `export_dir` (all of them unless `end_to_end` is False, which skips logits and
    generations); the report lists each result (see the module docstring)."""
    export_dir = Path(export_dir)
    manifest = read_manifest(export_dir)
    report = Report(export_dir, manifest["format"])
    check_files(export_dir, manifest, report)
    ref = _reference(manifest, reference, report)
    prompts = prompts or PROMPTS
    if manifest["format"] == ONNX and end_to_end:
        _check_onnx(export_dir, manifest, ref, prompts, report)
    if manifest["format"] == ONNX:
        return report
    tensors = _read_weights(export_dir, manifest, report)
    layers = _check_layers(manifest, tensors, ref, report)
    _check_dense_tensors(manifest, tensors, ref, report)
    _check_sparse_linear(manifest, tensors, layers, report, seed)
    complete = len(layers) == len(manifest["layers"]) and all(n in tensors for n in manifest["dense_tensors"])
    if not end_to_end:
        report.add("logits", "model", None, "not requested")
    elif ref is None:
        report.add("logits", "model", None, "no reference model")
    elif not complete:
        report.add("logits", "model", None, "the export is incomplete; fix the failures above first")
    else:
        _check_end_to_end(export_dir, manifest, tensors, layers, ref, prompts, max_new_tokens, report)
    return report


def check_files(export_dir: Path, manifest: dict, report: Report) -> None:
    listed = manifest["files"]
    for name, info in listed.items():
        path = export_dir / name
        if not path.is_file():
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


@dataclass
class Reference:
    spec: str
    path: Path
    masks: MaskSet
    dtype: torch.dtype | None
    tensors: dict[str, torch.Tensor]


def _reference(manifest: dict, reference: str | None, report: Report) -> Reference | None:
    """The source model and its masks; a missing reference skips the comparisons (and says so)."""
    spec = reference or manifest["source"]["path"]
    try:
        source = resolve_source(spec)
        masks = source.mask_set
    except LeapctlError as exc:
        mask_file = Path(manifest["masks"]["file"])
        if reference is None and not Path(spec).exists():
            report.add("reference", spec, None, f"not found ({exc}); pass --reference RUN_OR_MODEL")
            return None
        if not mask_file.is_file():
            report.add("reference", spec, None, f"no masks: {exc}")
            return None
        from leapctl.models import resolve_model

        source_path, masks = resolve_model(spec), load_masks(mask_file)
        spec = f"{spec} + {mask_file}"
    else:
        source_path = source.path
    dtype = DTYPES[manifest["dtype"]] if manifest.get("dtype") else None
    report.add("reference", spec, True, "masks from " + ("the reference run" if reference else "the source"))
    return Reference(spec, Path(source_path), masks, dtype, load_tensors(Path(source_path)))


def _read_weights(export_dir: Path, manifest: dict, report: Report) -> dict[str, torch.Tensor]:
    """Every readable tensor; an unreadable shard or a tensor missing from its indexed shard is a failure."""
    files = manifest["weight_files"]
    index_path = export_dir / INDEX_FILE
    weight_map = None
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            report.add("tensors", INDEX_FILE, False, f"unreadable index: {exc}")
    tensors: dict[str, torch.Tensor] = {}
    located: dict[str, str] = {}
    for name in files:
        try:
            with safe_open(str(export_dir / name), framework="pt") as handle:
                for key in handle.keys():
                    tensors[key] = handle.get_tensor(key)
                    located[key] = name
        except (SafetensorError, OSError) as exc:
            report.add("tensors", name, False, f"cannot read the shard: {exc}")
    if weight_map is not None:
        for key, name in weight_map.items():
            if located.get(key) != name and name in files:
                report.add("tensors", key, False, f"the index puts it in {name}, which does not hold it")
    expected = {t for info in manifest["layers"].values() for t in info["tensors"]}
    expected |= set(manifest["dense_tensors"])
    for key in sorted(set(tensors) - expected):
        report.add("tensors", key, False, f"unexpected tensor in {located[key]}")
    return tensors


def _layer_tensors(fmt: str, layer: str, info: dict,
                   tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One layer's encoding under the format's own names (compressed-tensors' renamed to bitmap's)."""
    renamed = {v: k for k, v in CT_NAMES.items()} if fmt == COMPRESSED_TENSORS else None
    out = {}
    for full in info["tensors"]:
        if full in tensors:
            key = full[len(layer) + 1:]
            out[renamed.get(key, key) if renamed else key] = tensors[full]
    return out


def _codec(fmt: str):
    return get_format("bitmap" if fmt == COMPRESSED_TENSORS else fmt)


def _reference_weight(ref: "Reference", ref_tensors: dict, name: str) -> torch.Tensor:
    weight = ref_tensors[name]
    if ref.dtype is not None and weight.is_floating_point():
        weight = weight.to(ref.dtype)
    return weight


def _check_layers(manifest: dict, tensors: dict, ref: Reference | None,
                  report: Report) -> dict[str, torch.Tensor]:
    """Format check and bit-exact decode of each pruned layer; returns the decoded weights that passed."""
    fmt = manifest["format"]
    codec = _codec(fmt)
    ref_tensors = ref.tensors if ref is not None else {}
    decoded_layers = {}
    for layer, info in manifest["layers"].items():
        parts = _layer_tensors(fmt, layer, info, tensors)
        missing = [t for t in info["tensors"] if t not in tensors]
        if missing:
            report.add("format", layer, False, f"tensor {', '.join(missing)} missing")
            continue
        try:
            codec.check(parts)
        except FormatError as exc:
            report.add("format", layer, False, str(exc))
            continue
        report.add("format", layer, True)
        decoded = codec.decode(parts)
        if list(decoded.shape) != info["shape"]:
            report.add("decode", layer, False, f"decodes to shape {list(decoded.shape)}, "
                                               f"manifest says {info['shape']}")
            continue
        weight_name = f"{layer}.weight"
        if ref is None:
            report.add("decode", layer, None, "no reference")
        elif weight_name not in ref.masks.masks or weight_name not in ref_tensors:
            report.add("decode", layer, False, f"the reference has no masked weight {weight_name}")
            continue
        else:
            mask = ref.masks.masks[weight_name]
            expected = masked_weight(_reference_weight(ref, ref_tensors, weight_name), mask)
            detail = _bit_difference(decoded, expected)
            if detail:
                report.add("decode", layer, False, detail)
                continue
            if fmt in ("bitmap", COMPRESSED_TENSORS):
                from sparse_formats import unpack_rows

                stored_mask = unpack_rows(parts["bitmap"], decoded.shape[1])
                if not torch.equal(stored_mask, mask):
                    report.add("decode", layer, False, f"bitmap differs from the reference mask at "
                                                       f"{int((stored_mask != mask).sum())} positions")
                    continue
            report.add("decode", layer, True, f"bit-exact, density {info['density']:.3f}")
        decoded_layers[layer] = decoded
    return decoded_layers


def _bit_difference(got: torch.Tensor, expected: torch.Tensor) -> str:
    """'' when equal bit for bit, else how many elements differ and where the first is."""
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return (f"decodes to {got.dtype} {tuple(got.shape)}, "
                f"reference is {expected.dtype} {tuple(expected.shape)}")
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    differs = got.contiguous().view(as_int) != expected.contiguous().view(as_int)
    if not bool(differs.any()):
        return ""
    first = differs.nonzero()[0].tolist()
    return (f"{int(differs.sum())} of {differs.numel()} weights differ from the reference, first at "
            f"{tuple(first)}: {got[tuple(first)].item()} vs {expected[tuple(first)].item()}")


def _check_dense_tensors(manifest: dict, tensors: dict, ref: Reference | None, report: Report) -> None:
    ref_tensors = ref.tensors if ref is not None else {}
    bad = 0
    for name in manifest["dense_tensors"]:
        if name not in tensors:
            report.add("dense", name, False, "missing")
            bad += 1
        elif ref is not None:
            if name not in ref_tensors:
                report.add("dense", name, False, "the reference has no such tensor")
                bad += 1
                continue
            detail = _bit_difference(tensors[name], _reference_weight(ref, ref_tensors, name))
            if detail:
                report.add("dense", name, False, detail)
                bad += 1
    if not bad:
        report.add("dense", f"{len(manifest['dense_tensors'])} tensors", True if ref else None,
                   "bit-exact" if ref else "present; no reference")


def _check_sparse_linear(manifest: dict, tensors: dict, layers: dict, report: Report, seed: int) -> None:
    """serving's CPU ops on each layer against the dense masked matmul in the same dtype: the decode op
    and the native kernel on each instruction set this CPU runs (when it can be built here)."""
    fmt = manifest["format"]
    if fmt not in SERVED_FORMATS:
        report.add("sparse-linear", "all layers", None, f"{fmt} is not a serving format")
        return
    try:
        from serving import cpu_kernel
        from serving.sparse_linear import BitmapWeight, bitmap_linear
    except ImportError as exc:
        report.add("sparse-linear", "all layers", None, f"serving.sparse_linear is not importable: {exc}")
        return
    paths = {"decode": lambda: nullcontext()}
    try:
        native = cpu_kernel.load()
    except ValueError as exc:  # a bad LEAP_SPARSE_CPU_ISA
        raise LeapctlError(str(exc)) from None
    if native:
        paths |= {isa: partial(cpu_kernel.using_isa, isa) for isa in cpu_kernel.supported_isas()}
    else:
        report.add("sparse-linear", "native CPU kernel", None,
                   f"not checked: {cpu_kernel.unavailable_reason()}")
    gen = torch.Generator().manual_seed(seed)
    for layer, weight in layers.items():
        parts = _layer_tensors(fmt, layer, manifest["layers"][layer], tensors)
        stored = BitmapWeight.from_tensors("csr" if fmt == "csr" else "bitmap", parts)
        x = torch.randn(4, weight.shape[1], generator=gen).to(weight.dtype)
        expected = torch.nn.functional.linear(x, weight)
        rtol, atol = MATMUL_TOLERANCE.get(weight.dtype, (1e-5, 1e-5))
        scale = max(1.0, float(expected.abs().max()))
        errors, wrong = {}, []
        for name, active in paths.items():
            with active():
                op = bitmap_linear if name == "decode" else torch.ops.leap_sparse_cpu.bitmap_linear
                got = op(x, stored.bitmap, stored.values, stored.row_offsets, stored.n_cols)
            if got.shape != expected.shape:
                wrong.append(f"{name}: output shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
                continue
            errors[name] = float((got.float() - expected.float()).abs().max())
            if not torch.allclose(got.float(), expected.float(), rtol=rtol, atol=atol * scale):
                wrong.append(f"{name}: max |difference| {errors[name]:.3g}")
        if wrong:
            report.add("sparse-linear", layer, False, f"{'; '.join(wrong)} ({weight.dtype})")
        else:
            report.add("sparse-linear", layer, True,
                       f"max |difference| {max(errors.values()):.3g} ({weight.dtype}; {', '.join(paths)})")


def _dense_model_from_export(export_dir: Path, manifest: dict, tensors: dict, layers: dict,
                             dtype: torch.dtype):
    """The export decoded back into an ordinary transformers model, built from the export's own config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(export_dir)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    encoded = {name for info in manifest["layers"].values() for name in info["tensors"]}
    state = {name: t for name, t in tensors.items() if name not in encoded}
    state.update({f"{layer}.weight": weight for layer, weight in layers.items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    if getattr(config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
        missing = [m for m in missing if not m.startswith("lm_head.")]
    if missing or unexpected:
        raise LeapctlError(f"the decoded export does not fit its config: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    return model.eval()


def _check_end_to_end(export_dir: Path, manifest: dict, tensors: dict, layers: dict, ref: Reference,
                      prompts: list[str], max_new_tokens: int, report: Report) -> None:
    from transformers import AutoTokenizer

    dtype = next(iter(layers.values())).dtype
    reference_model, _ = load_masked_model(ref.path, ref.masks, dtype)
    try:
        exported = _dense_model_from_export(export_dir, manifest, tensors, layers, dtype)
    except LeapctlError as exc:
        report.add("logits", "model", False, str(exc))
        return
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    input_ids = sample_ids(tokenizer, prompts)
    with torch.no_grad():
        got = exported(input_ids=input_ids).logits.float()
        expected = reference_model(input_ids=input_ids).logits.float()
    difference = float((got - expected).abs().max())
    report.add("logits", f"{len(prompts)} prompts", difference == 0.0, f"max |difference| {difference:.3g}")
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        with torch.no_grad():
            a = exported.generate(ids, **kwargs)[0, ids.shape[1]:].tolist()
            b = reference_model.generate(ids, **kwargs)[0, ids.shape[1]:].tolist()
        detail = repr(tokenizer.decode(a))
        if a != b:
            detail += f" vs reference {tokenizer.decode(b)!r}"
        report.add("generate", repr(prompt), a == b, detail)


def _check_onnx(export_dir: Path, manifest: dict, ref: Reference | None, prompts: list[str],
                report: Report) -> None:
    if ref is None:
        report.add("logits", "model.onnx", None, "no reference model")
        return
    if any(c.ok is False and c.target.startswith("model.onnx") for c in report.checks):
        report.add("logits", "model.onnx", None, "model.onnx failed its checksum")
        return
    from transformers import AutoTokenizer

    model, _ = load_masked_model(ref.path, ref.masks, ref.dtype or torch.float32)
    _check_onnx_weights(export_dir / "model.onnx", manifest, model, report)
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    input_ids = sample_ids(tokenizer, prompts)
    with torch.no_grad():
        expected = model(input_ids=input_ids, use_cache=False).logits.float()
    try:
        got = onnx_logits(export_dir / "model.onnx", input_ids).float()
    except Exception as exc:  # onnxruntime raises its own exception types for broken models
        report.add("logits", "model.onnx", False, f"onnxruntime cannot run it: {str(exc).splitlines()[0]}")
        return
    difference = float((got - expected).abs().max())
    tolerance = 1e-3 * max(1.0, float(expected.abs().max()))
    report.add("logits", "model.onnx", difference <= tolerance,
               f"onnxruntime vs torch max |difference| {difference:.3g} (tolerance {tolerance:.3g})")



def _check_onnx_weights(model_file: Path, manifest: dict, model: torch.nn.Module, report: Report) -> None:
    """Each pruned weight, masked, is among the ONNX initializers bit for bit. The exporter folds the
    transposes of linear weights into anonymous constants, so they are matched by content hash."""
    import hashlib

    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(model_file)).graph
    stored = {}
    for init in graph.initializer:
        if len(init.dims) == 2:
            array = numpy_helper.to_array(init)
            stored[hashlib.sha256(array.tobytes()).hexdigest()] = init.name
    params = dict(model.named_parameters())
    for layer in manifest["layers"]:
        weight = params[f"{layer}.weight"].detach()
        found = [stored.get(hashlib.sha256(w.contiguous().numpy().tobytes()).hexdigest())
                 for w in (weight, weight.T)]
        name = next((n for n in found if n), None)
        report.add("decode", layer, name is not None,
                   f"masked weight stored as {name}" if name else "masked weight not found in model.onnx")
