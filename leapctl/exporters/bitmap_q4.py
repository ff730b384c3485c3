"""`bitmap-q4`: the 4-bit sparse serving checkpoint (`sparse_formats.bitmap_q4`) of a quantized run folder
(`leapctl quantize`, or `learn --bits 4`). Each pruned linear X is stored as `X.shape`, `X.bitmap`, `X.codes`,
`X.scales` and `X.row_offsets`; the codes are recomputed from the run's fp32 weights and its stored scales,
and a weight off that grid is refused, so the export decodes to the run bit for bit. Other tensors stay
fp32 (the run's dtype; vLLM casts them at load). Validation adds serving's ops on every layer: the
per-call decode op and the native kernel on every instruction set this CPU runs, against the dequantized
dense matmul."""

from functools import partial

import torch

from leapctl.errors import LeapctlError
from leapctl.exporters.base import Report, ValidateOptions, compute_paths, register
from leapctl.exporters.checkpoint import SparseCheckpointExporter
from leapctl.quantize import ASYMMETRIC, LM_HEAD, SYMMETRIC, lm_head_bits
from leapctl.runs import Run
from serving.contract import LeapSparseSettings
from sparse_formats import get_format
from sparse_formats.int8_rows import INT8_ROWS

HEAD_INT8 = INT8_ROWS.name  # lm_head's codec when the run put it on the 8-bit grid

# (rtol, atol relative to the output's scale): fp32 sums in another order; bf16 outputs rounded to 8 bits
# (and the decode path's weight rounded to bf16 too).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2)}


class BitmapQ4Exporter(SparseCheckpointExporter):
    name = codec_name = "bitmap-q4"
    summary = ("4-bit sparse serving checkpoint of a quantized run (leapctl quantize): per pruned linear X, "
               "`X.bitmap`, `X.codes` (4-bit codes of the kept weights), `X.scales` (fp16 per row and "
               "group) and `X.row_offsets` (int32); about 0.41 bytes per weight at 50% sparsity.")
    value_dtypes = (torch.float32,)
    servable = True

    def check_source(self, source: Run) -> None:
        if source.scales is None:
            raise LeapctlError(f"{source.spec} is not quantized (no leapctl/scales.safetensors): run "
                               f"`leapctl quantize {source.spec} --out DIR` and export DIR")

    def encoded_weights(self, run: Run, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The pruned weights, and lm_head with every weight kept when the run quantized it (a tied lm_head
        has no tensor of its own: it gets the embedding's, which holds the same grid values)."""
        masks = dict(run.masks.masks)
        if run.scales is not None and LM_HEAD in run.scales:
            if LM_HEAD not in tensors:
                tied = [n for n, t in tensors.items() if n.endswith("embed_tokens.weight")
                        and tuple(t.shape) == tuple(run.scales[LM_HEAD].shape[:1]) + (t.shape[1],)]
                if not tied:
                    raise LeapctlError("the run quantized lm_head but holds neither it nor a tied embedding")
                tensors[LM_HEAD] = tensors[tied[0]]
            masks[LM_HEAD] = torch.ones(tensors[LM_HEAD].shape, dtype=torch.bool)
        return masks

    def layer_format(self, source: Run, name: str) -> str:
        """int8-rows for an lm_head the run put on the 8-bit grid, bitmap-q4 for every other weight."""
        if name == LM_HEAD and lm_head_bits(source.report.get("quantization") or {}) == 8:
            return HEAD_INT8
        return self.codec_name

    def encode_layer(self, source: Run, name: str, weight: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
        if name not in source.scales:
            raise ValueError("the run has no scales for it")
        fmt = self.layer_format(source, name)
        if fmt == HEAD_INT8:
            return get_format(fmt).encode(weight, mask, scales=source.scales[name])
        zeros = (source.zeros or {}).get(name)
        return get_format(fmt).encode(weight, mask, scales=source.scales[name], zeros=zeros)

    def quantization_config(self, source: Run, ignore: list[str], sparsity: float,
                            layer_formats: dict[str, str]) -> dict:
        return LeapSparseSettings(fmt=self.name, sparsity=sparsity, ignore=tuple(ignore),
                                  lm_head_format=layer_formats.get("lm_head", ""),
                                  grid=grid_of(source)).to_config()

    def check_compute(self, manifest: dict, tensors: dict, layers: dict[str, torch.Tensor], report: Report,
                      options: ValidateOptions) -> None:
        """serving's ops on each layer against x W^T with the decoded fp32 weight, for fp32 and bf16 x (an
        8-bit lm_head: x rounded to int8 per row first, as its ops do)."""
        from serving.int8_linear import (
            Int8Weight,
            NativeInt8,
            OneDNNInt8,
            int8_rows_activations,
            int8_rows_linear,
            native_int8_available,
            onednn_int8_available,
        )
        from serving.q4_linear import Q4Weight, bitmap_q4_linear

        q4_paths = compute_paths(report, "bitmap_q4_linear")
        gen = torch.Generator().manual_seed(options.seed)
        for layer, weight in layers.items():
            info = manifest["layers"][layer]
            parts = self.layer_tensors(layer, info, tensors)
            if info.get("format") == HEAD_INT8:
                stored = Int8Weight.from_tensors(HEAD_INT8, parts)
                ops = {"decode": lambda x, w=stored: int8_rows_linear(x, w.qweight, w.scales)}
                if native_int8_available(stored.n_cols):  # the decoding steps' op, as a layer holds it
                    ops["native"] = NativeInt8(stored, torch.float32)
                if onednn_int8_available():  # packed once per output dtype, as a layer does at load
                    packed = {dtype: OneDNNInt8(stored, dtype) for dtype in TOLERANCE}
                    ops["oneDNN"] = lambda x, packed=packed: packed[x.dtype](x)
                self._check_ops(layer, weight, ops, int8_rows_activations, report, gen)
                continue
            stored = Q4Weight.from_tensors(self.name, parts)
            args = (stored.bitmap, stored.codes, stored.scales, stored.row_offsets, stored.n_cols, None,
                    stored.zeros)
            ops = {name: partial(_call_in, active, bitmap_q4_linear if name == "decode" else _native_q4, args)
                   for name, active in q4_paths.items()}
            self._check_ops(layer, weight, ops, lambda x: x.float(), report, gen)

    @staticmethod
    def _check_ops(layer: str, weight: torch.Tensor, ops: dict, x_as_multiplied, report: Report,
                   gen: torch.Generator) -> None:
        """One sparse-linear line: every op (name -> f(x)) against x_as_multiplied(x) W^T in fp32."""
        wrong, worst = [], 0.0
        for dtype, (rtol, atol) in TOLERANCE.items():
            x = torch.randn(4, weight.shape[1], generator=gen).to(dtype)
            expected = torch.nn.functional.linear(x_as_multiplied(x), weight.float())
            scale = max(1.0, float(expected.abs().max()))
            for name, op in ops.items():
                got = op(x).float()
                if got.shape != expected.shape:
                    wrong.append(f"{name}: output shape {tuple(got.shape)}, not {tuple(expected.shape)}")
                    continue
                error = float((got - expected).abs().max())
                worst = max(worst, error / scale)
                if not torch.allclose(got, expected, rtol=rtol, atol=atol * scale):
                    wrong.append(f"{name} {dtype}: max |difference| {error:.3g}")
        report.add("sparse-linear", layer, not wrong,
                   "; ".join(wrong) if wrong else f"max |difference| {worst:.3g} of the output's scale "
                                                  f"(fp32, bf16; {', '.join(ops)})")


def grid_of(run: Run) -> str:
    """The 4-bit grid a quantized run's kept weights sit on: asymmetric where it holds zero points."""
    return ASYMMETRIC if run.zeros else SYMMETRIC


def _native_q4(x: torch.Tensor, *args) -> torch.Tensor:
    """The native op on a layout `Q4Weight.from_tensors` checked, so without its own offset check."""
    return torch.ops.leap_sparse_cpu.bitmap_q4_linear(x, *args, checked=True)


def _call_in(active, op, args: tuple, x: torch.Tensor) -> torch.Tensor:
    """op(x, *args) inside the context `active()` (a compute path: the portable op, an ISA)."""
    with active():
        return op(x, *args)


register(BitmapQ4Exporter())
