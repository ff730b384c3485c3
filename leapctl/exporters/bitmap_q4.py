"""`bitmap-q4`: the 4-bit sparse serving checkpoint (`sparse_formats.bitmap_q4`) of a quantized run folder
(`leapctl quantize`, or `learn --bits 4`). Each pruned linear X is stored as `X.shape`, `X.bitmap`, `X.codes`,
`X.scales` and `X.row_offsets`; the codes are recomputed from the run's fp32 weights and its stored scales,
and a weight off that grid is refused, so the export decodes to the run bit for bit. Other tensors stay
fp32 (the run's dtype; vLLM casts them at load). Validation adds serving's ops on every layer: the
per-call decode op and the native kernel on every instruction set this CPU runs, against the dequantized
dense matmul."""

import torch

from leapctl.errors import LeapctlError
from leapctl.exporters.base import Report, ValidateOptions, compute_paths, register
from leapctl.exporters.checkpoint import SparseCheckpointExporter
from leapctl.quantize import LM_HEAD
from leapctl.runs import Run
from serving.contract import LeapSparseSettings

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

    def encode_layer(self, source: Run, name: str, weight: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
        if name not in source.scales:
            raise ValueError("the run has no scales for it")
        return self.codec.encode(weight, mask, scales=source.scales[name])

    def quantization_config(self, ignore: list[str], sparsity: float) -> dict:
        return LeapSparseSettings(fmt=self.name, sparsity=sparsity, ignore=tuple(ignore)).to_config()

    def check_compute(self, manifest: dict, tensors: dict, layers: dict[str, torch.Tensor], report: Report,
                      options: ValidateOptions) -> None:
        """serving's ops on each layer against x W^T with the decoded fp32 weight, for fp32 and bf16 x."""
        from serving.q4_linear import Q4Weight, bitmap_q4_linear

        paths = compute_paths(report, "bitmap_q4_linear")
        gen = torch.Generator().manual_seed(options.seed)
        for layer, weight in layers.items():
            stored = Q4Weight.from_tensors(self.name, self.layer_tensors(layer, manifest["layers"][layer],
                                                                         tensors))
            wrong, worst = [], 0.0
            for dtype, (rtol, atol) in TOLERANCE.items():
                x = torch.randn(4, weight.shape[1], generator=gen).to(dtype)
                expected = torch.nn.functional.linear(x.float(), weight.float())
                scale = max(1.0, float(expected.abs().max()))
                for name, active in paths.items():
                    op = bitmap_q4_linear if name == "decode" else torch.ops.leap_sparse_cpu.bitmap_q4_linear
                    with active():
                        got = op(x, stored.bitmap, stored.codes, stored.scales, stored.row_offsets,
                                 stored.n_cols).float()
                    if got.shape != expected.shape:
                        wrong.append(f"{name}: output shape {tuple(got.shape)}, not {tuple(expected.shape)}")
                        continue
                    error = float((got - expected).abs().max())
                    worst = max(worst, error / scale)
                    if not torch.allclose(got, expected, rtol=rtol, atol=atol * scale):
                        wrong.append(f"{name} {dtype}: max |difference| {error:.3g}")
            report.add("sparse-linear", layer, not wrong,
                       "; ".join(wrong) if wrong else f"max |difference| {worst:.3g} of the output's scale "
                                                      f"(fp32, bf16; {', '.join(paths)})")


register(BitmapQ4Exporter())
