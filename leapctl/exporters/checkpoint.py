"""A Hugging Face checkpoint whose pruned linears are stored in a sparse format: the writer, reader and
checks that the `leap_sparse`, tiled and compressed-tensors targets share. A target says which
`sparse_formats` codec encodes a layer, how its tensors are named on disk and what `quantization_config`
the config gains; everything else (sharding, dense tensors, the bit-exact decode and the end-to-end
comparison with the reference model) is the same for all of them."""

import json
from abc import abstractmethod
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from leapctl.compute import dtype_name
from leapctl.errors import LeapctlError, one_line
from leapctl.exporters.base import (
    INDEX_FILE,
    Exporter,
    ExportOptions,
    Reference,
    Report,
    ShardWriter,
    ValidateOptions,
    Written,
    bit_difference,
    linear_names,
    load_masked_model,
    load_tensors,
    sample_ids,
    source_config,
)
from leapctl.masks import masked_weight
from leapctl.runs import Run
from sparse_formats import FormatError, get_format, nbytes, unpack_rows


class SparseCheckpointExporter(Exporter):
    """Pruned linear X stored as `X.<stored name>` tensors of `codec`; every other tensor as it is."""

    codec_name: str = ""
    stored_names: dict[str, str] = {}  # codec tensor name -> name on disk, where they differ
    manifest_lists = ("weight_files", "dense_tensors")

    @abstractmethod
    def quantization_config(self, source: Run, ignore: list[str], sparsity: float,
                            layer_formats: dict[str, str]) -> dict:
        """The `quantization_config` entry of the exported config.json (`layer_formats`: the layers stored in
        another codec than the target's, e.g. {"lm_head": "int8-rows"})."""

    @property
    def codec(self):
        return get_format(self.codec_name)

    # ------------------------------------------------------------------------ writer

    def encoded_weights(self, run: Run, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Weight name -> keep-mask of every weight stored in the codec's layout: the run's pruned weights
        (a target that also stores dense layers that way adds them, and their tensors, here)."""
        return run.masks.masks

    def layer_format(self, source: Run, name: str) -> str:
        """The codec of one encoded weight: the target's own, unless the target stores some (an 8-bit
        lm_head) in another."""
        return self.codec_name

    def encode_layer(self, source: Run, name: str, weight: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """One pruned weight in the codec's tensors (a target with more than weight and mask overrides)."""
        return self.codec.encode(weight, mask)

    def write(self, source: Run, out: Path, options: ExportOptions) -> Written:
        config = source_config(source)
        tensors = load_tensors(source.path)
        masks = self.encoded_weights(source, tensors)
        for name in masks:
            if name not in tensors:
                raise LeapctlError(f"the masks name {name}, which {source.spec} does not have")
        writer = ShardWriter(out, options.max_shard_bytes)
        layers, layer_formats = {}, {}
        for name, tensor in tensors.items():
            if options.dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(options.dtype)
            if name not in masks:
                writer.add({name: tensor})
                continue
            mask = masks[name]
            if tuple(mask.shape) != tuple(tensor.shape):
                raise LeapctlError(f"mask for {name} has shape {tuple(mask.shape)}, "
                                   f"weight has {tuple(tensor.shape)}")
            try:
                encoded = self.encode_layer(source, name, tensor, mask)
            except ValueError as exc:
                raise LeapctlError(f"cannot encode {name} as {self.name}: {exc}") from None
            layer = name.removesuffix(".weight")
            group = {f"{layer}.{self.stored_names.get(key, key)}": value for key, value in encoded.items()}
            writer.add(group)
            kept = int(mask.sum())
            layers[layer] = {"shape": list(tensor.shape), "dtype": dtype_name(tensor.dtype), "kept": kept,
                             "density": kept / mask.numel(),
                             "dense_bytes": tensor.numel() * tensor.element_size(),
                             "sparse_bytes": nbytes(encoded), "tensors": sorted(group)}
            fmt = self.layer_format(source, name)
            if fmt != self.codec_name:
                layers[layer]["format"] = layer_formats[layer] = fmt
        weight_map = writer.finish()
        for info in layers.values():
            info["file"] = weight_map[info["tensors"][0]]

        dense_names = [name for name in tensors if name not in masks]
        ignore = sorted(name for name in linear_names(config) if f"{name}.weight" not in masks)
        config_dict = config.to_dict()
        if "lm_head.weight" in masks:  # stored in the codec's layout, so no longer the embedding's tensor
            config_dict["tie_word_embeddings"] = False
        if options.dtype is not None:
            config_dict["dtype"] = dtype_name(options.dtype)
            config_dict.pop("torch_dtype", None)
        sparsity = source.masks.sparsity()["global"]
        config_dict["quantization_config"] = self.quantization_config(source, ignore, sparsity, layer_formats)
        (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")

        def size(name: str) -> int:
            tensor = tensors[name]
            itemsize = options.dtype.itemsize if options.dtype and tensor.is_floating_point() else None
            return tensor.numel() * (itemsize or tensor.element_size())

        pruned_dense = sum(info["dense_bytes"] for info in layers.values())
        totals = {"pruned_dense_bytes": pruned_dense,
                  "pruned_sparse_bytes": sum(info["sparse_bytes"] for info in layers.values()),
                  "checkpoint_dense_bytes": pruned_dense + sum(size(n) for n in dense_names),
                  "checkpoint_sparse_bytes": writer.total_bytes}
        return Written(layers, totals, {"dense_tensors": sorted(dense_names), "ignore": ignore,
                                        "weight_files": sorted(set(weight_map.values()))})

    # ------------------------------------------------------------------------ reader

    def read(self, export_dir: Path, manifest: dict, report: Report | None = None) -> dict[str, torch.Tensor]:
        """Every readable tensor of the shards; an unreadable shard, a tensor missing from the shard its
        index names and a tensor the manifest does not expect are reported."""
        report = report if report is not None else Report(export_dir, self.name)
        files = manifest["weight_files"]
        weight_map = None
        index_path = export_dir / INDEX_FILE
        if index_path.is_file():
            try:
                weight_map = dict(json.loads(index_path.read_text())["weight_map"])
            except (ValueError, KeyError, TypeError) as exc:  # not JSON, no map, not a map
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

    def layer_tensors(self, layer: str, info: dict,
                      tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One layer's encoding under the codec's own names."""
        codec_names = {stored: key for key, stored in self.stored_names.items()}
        out = {}
        for full in info["tensors"]:
            if full in tensors:
                stored = full[len(layer) + 1:]
                out[codec_names.get(stored, stored)] = tensors[full]
        return out

    # ------------------------------------------------------------------------ checks

    def check(self, export_dir: Path, manifest: dict, reference: Reference | None, report: Report,
              options: ValidateOptions) -> None:
        tensors = self.read(export_dir, manifest, report)
        layers = self._check_layers(manifest, tensors, reference, report)
        self._check_dense_tensors(manifest, tensors, reference, report)
        self.check_compute(manifest, tensors, layers, report, options)
        complete = (len(layers) == len(manifest["layers"])
                    and all(n in tensors for n in manifest["dense_tensors"]))
        if not options.end_to_end:
            report.add("logits", "model", None, "not requested")
        elif reference is None:
            report.add("logits", "model", None, "no reference model")
        elif not complete:
            report.add("logits", "model", None, "the export is incomplete; fix the failures above first")
        else:
            self._check_end_to_end(export_dir, manifest, tensors, layers, reference, report, options)

    def check_compute(self, manifest: dict, tensors: dict, layers: dict[str, torch.Tensor], report: Report,
                      options: ValidateOptions) -> None:
        """Checks of the kernels that compute with this format; none unless a target adds them."""

    def _check_layers(self, manifest: dict, tensors: dict, reference: Reference | None,
                      report: Report) -> dict[str, torch.Tensor]:
        """Format check and bit-exact decode of each pruned layer; returns the decoded weights that passed."""
        decoded_layers = {}
        reference_masks = {} if reference is None else self.encoded_weights(reference.run, reference.tensors)
        for layer, info in manifest["layers"].items():
            parts = self.layer_tensors(layer, info, tensors)
            missing = [t for t in info["tensors"] if t not in tensors]
            if missing:
                report.add("format", layer, False, f"tensor {', '.join(missing)} missing")
                continue
            try:
                codec = get_format(info.get("format", self.codec_name))
            except KeyError as exc:
                report.add("format", layer, False, f"the manifest names {exc}")
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
            if reference is None:
                report.add("decode", layer, None, "no reference")
            elif weight_name not in reference_masks or weight_name not in reference.tensors:
                report.add("decode", layer, False, f"the reference has no masked weight {weight_name}")
                continue
            else:
                mask = reference_masks[weight_name]
                detail = bit_difference(decoded, masked_weight(reference.weight(weight_name), mask))
                if not detail and "bitmap" in parts and codec.name in ("bitmap", "bitmap-q4"):
                    stored_mask = unpack_rows(parts["bitmap"], decoded.shape[1])
                    if not torch.equal(stored_mask, mask):
                        detail = (f"bitmap differs from the reference mask at "
                                  f"{int((stored_mask != mask).sum())} positions")
                if detail:
                    report.add("decode", layer, False, detail)
                    continue
                report.add("decode", layer, True, f"bit-exact, density {info['density']:.3f}")
            decoded_layers[layer] = decoded
        return decoded_layers

    def _check_dense_tensors(self, manifest: dict, tensors: dict, reference: Reference | None,
                             report: Report) -> None:
        bad = 0
        for name in manifest["dense_tensors"]:
            if name not in tensors:
                report.add("dense", name, False, "missing")
                bad += 1
            elif reference is not None:
                if name not in reference.tensors:
                    report.add("dense", name, False, "the reference has no such tensor")
                    bad += 1
                    continue
                detail = bit_difference(tensors[name], reference.weight(name))
                if detail:
                    report.add("dense", name, False, detail)
                    bad += 1
        if not bad:
            report.add("dense", f"{len(manifest['dense_tensors'])} tensors", True if reference else None,
                       "bit-exact" if reference else "present; no reference")

    def dense_model(self, export_dir: Path, manifest: dict, tensors: dict, layers: dict[str, torch.Tensor],
                    dtype: torch.dtype):
        """The export decoded back into an ordinary transformers model, built from the export's own config."""
        from transformers import AutoConfig, AutoModelForCausalLM

        try:  # the export's config.json may be anything (re-hashed into the manifest by hand)
            config = AutoConfig.from_pretrained(export_dir)
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        except Exception as exc:  # transformers raises many types for a config it cannot use
            raise LeapctlError(f"no model can be built from {export_dir}/config.json: "
                               f"{one_line(exc)}") from None
        encoded = {name for info in manifest["layers"].values() for name in info["tensors"]}
        state = {name: t for name, t in tensors.items() if name not in encoded}
        state.update({f"{layer}.weight": weight for layer, weight in layers.items()})
        try:
            missing, unexpected = model.load_state_dict(state, strict=False)
        except RuntimeError as exc:  # shapes that differ from the config's
            raise LeapctlError(f"the decoded export does not fit its config.json: {one_line(exc)}") from None
        if getattr(config.get_text_config(), "tie_word_embeddings", False):
            model.tie_weights()
            missing = [m for m in missing if not m.startswith("lm_head.")]
        if missing or unexpected:
            raise LeapctlError(f"the decoded export does not fit its config: missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]}")
        return model.eval()

    def _check_end_to_end(self, export_dir: Path, manifest: dict, tensors: dict, layers: dict,
                          reference: Reference, report: Report, options: ValidateOptions) -> None:
        from transformers import AutoTokenizer

        dtype = next(iter(layers.values())).dtype
        reference_model, _ = load_masked_model(reference.run.path, reference.masks, dtype)
        try:
            exported = self.dense_model(export_dir, manifest, tensors, layers, dtype)
        except LeapctlError as exc:
            report.add("logits", "model", False, str(exc))
            return
        tokenizer = AutoTokenizer.from_pretrained(export_dir)
        input_ids = sample_ids(tokenizer, options.prompts)
        with torch.no_grad():
            got = exported(input_ids=input_ids).logits.float()
            expected = reference_model(input_ids=input_ids).logits.float()
        difference = float((got - expected).abs().max())
        report.add("logits", f"{len(options.prompts)} prompts", difference == 0.0,
                   f"max |difference| {difference:.3g}")
        for prompt in options.prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            kwargs = dict(max_new_tokens=options.max_new_tokens, do_sample=False,
                          pad_token_id=tokenizer.eos_token_id)
            with torch.no_grad():
                a = exported.generate(ids, **kwargs)[0, ids.shape[1]:].tolist()
                b = reference_model.generate(ids, **kwargs)[0, ids.shape[1]:].tolist()
            detail = repr(tokenizer.decode(a))
            if a != b:
                detail += f" vs reference {tokenizer.decode(b)!r}"
            report.add("generate", repr(prompt), a == b, detail)
