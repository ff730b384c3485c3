"""`onnx`: the masked model, dense with zeros, as `model.onnx` + `model.onnx.data`; checked against torch
with onnxruntime before it is written, and again by `leapctl validate`."""

import hashlib
from pathlib import Path

import torch

from leapctl.compute import dtype_name
from leapctl.errors import LeapctlError
from leapctl.exporters.base import (
    Exporter,
    ExportOptions,
    Reference,
    Report,
    ValidateOptions,
    Written,
    load_masked_model,
    register,
    sample_ids,
)
from leapctl.runs import Run

MODEL_FILE = "model.onnx"
EXPORT_PROMPTS = ["Once upon a time", "The little dog"]


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


def logit_tolerance(expected: torch.Tensor) -> float:
    """onnxruntime and torch order float sums differently: 1e-3 of the logits' scale."""
    return 1e-3 * max(1.0, float(expected.abs().max()))


class OnnxExporter(Exporter):
    name = "onnx"
    summary = ("The masked model (dense with zeros) as `model.onnx` + `model.onnx.data`, checked against "
               "torch with onnxruntime before it is written.")
    layer_tensors = False  # the graph folds the weights in: its layers list no tensor names

    def write(self, source: Run, out: Path, options: ExportOptions) -> Written:
        try:
            import onnxruntime  # noqa: F401
            import onnxscript  # noqa: F401
        except ImportError as exc:
            raise LeapctlError(f"onnx export needs onnxruntime and onnxscript ({exc})") from None
        model, tokenizer = load_masked_model(source.path, source.masks, options.dtype or torch.float32)
        wrapper = _LogitsOnly(model).eval()
        input_ids = sample_ids(tokenizer, EXPORT_PROMPTS)
        batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("sequence", min=2, max=4096)
        model_file = out / MODEL_FILE
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
        tolerance = logit_tolerance(expected)
        if difference > tolerance:
            raise LeapctlError(f"onnxruntime logits differ from torch by {difference:.3g} "
                               f"(> {tolerance:.3g})")
        model.config.to_json_file(out / "config.json")
        params = dict(model.named_parameters())
        layers = {}
        for name, mask in source.masks.masks.items():
            weight = params[name]
            kept = int(mask.sum())
            size = weight.numel() * weight.element_size()
            layers[name.removesuffix(".weight")] = {
                "shape": list(weight.shape), "dtype": dtype_name(weight.dtype), "kept": kept,
                "density": kept / mask.numel(), "dense_bytes": size, "sparse_bytes": size}
        pruned = sum(info["dense_bytes"] for info in layers.values())
        return Written(layers, {"pruned_dense_bytes": pruned, "pruned_sparse_bytes": pruned},
                       {"onnx_check": {"prompts": EXPORT_PROMPTS, "max_abs_logit_diff": difference,
                                       "tolerance": tolerance}})

    def read(self, export_dir: Path, manifest: dict, report: Report | None = None) -> dict[str, torch.Tensor]:
        """The graph's 2-D constants by initializer name (the exporter names folded weights itself)."""
        import onnx
        from onnx import numpy_helper

        graph = onnx.load(str(export_dir / MODEL_FILE)).graph
        return {init.name: torch.from_numpy(numpy_helper.to_array(init).copy())
                for init in graph.initializer if len(init.dims) == 2}

    def check(self, export_dir: Path, manifest: dict, reference: Reference | None, report: Report,
              options: ValidateOptions) -> None:
        if not options.end_to_end:
            report.add("logits", MODEL_FILE, None, "not requested")
            return
        if reference is None:
            report.add("logits", MODEL_FILE, None, "no reference model")
            return
        if any(c.ok is False and c.target.startswith(MODEL_FILE) for c in report.checks):
            report.add("logits", MODEL_FILE, None, f"{MODEL_FILE} failed its checksum")
            return
        from transformers import AutoTokenizer

        model, _ = load_masked_model(reference.run.path, reference.masks, reference.dtype or torch.float32)
        self._check_weights(export_dir, manifest, model, report)
        tokenizer = AutoTokenizer.from_pretrained(export_dir)
        input_ids = sample_ids(tokenizer, options.prompts)
        with torch.no_grad():
            expected = model(input_ids=input_ids, use_cache=False).logits.float()
        try:
            got = onnx_logits(export_dir / MODEL_FILE, input_ids).float()
        except Exception as exc:  # onnxruntime raises its own exception types for broken models
            report.add("logits", MODEL_FILE, False, f"onnxruntime cannot run it: {str(exc).splitlines()[0]}")
            return
        difference = float((got - expected).abs().max())
        tolerance = logit_tolerance(expected)
        report.add("logits", MODEL_FILE, difference <= tolerance,
                   f"onnxruntime vs torch max |difference| {difference:.3g} (tolerance {tolerance:.3g})")

    def _check_weights(self, export_dir: Path, manifest: dict, model: torch.nn.Module,
                       report: Report) -> None:
        """Each pruned weight, masked, is among the ONNX constants bit for bit. The exporter folds the
        transposes of linear weights into anonymous constants, so they are matched by content hash."""

        def digest(tensor: torch.Tensor) -> str:
            return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()

        stored = {digest(tensor): name for name, tensor in self.read(export_dir, manifest).items()}
        params = dict(model.named_parameters())
        for layer in manifest["layers"]:
            weight = params[f"{layer}.weight"].detach()
            name = next((stored[d] for d in (digest(weight), digest(weight.T)) if d in stored), None)
            detail = f"masked weight stored as {name}" if name else f"masked weight not found in {MODEL_FILE}"
            report.add("decode", layer, name is not None, detail)


register(OnnxExporter())
