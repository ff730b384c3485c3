"""`bitmap` and `csr`: the serving checkpoints `leapctl serve` loads through the `leap_sparse` vLLM plugin.
Each pruned linear X is stored as `X.shape` plus the format's tensors (`X.bitmap`, `X.values`,
`X.row_offsets` for bitmap); q/k/v and gate/up stay separate because vLLM routes `q_proj.bitmap` to the `q`
shard of `qkv_proj`. Besides the shared checks, validation runs serving's own CPU ops on every layer: the
per-call decode op and the native kernel on every instruction set this CPU runs (AVX-512, AVX2)."""

import torch

from leapctl.exporters.base import Report, ValidateOptions, compute_paths, register
from leapctl.exporters.checkpoint import SparseCheckpointExporter
from leapctl.runs import Run
from serving.contract import LeapSparseSettings

# (rtol, atol relative to the output's scale) for comparing a matmul done two ways in one dtype
MATMUL_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


class LeapSparseExporter(SparseCheckpointExporter):
    servable = True

    def __init__(self, fmt: str, summary: str):
        self.name = self.codec_name = fmt
        self.summary = summary

    def quantization_config(self, source: Run, ignore: list[str], sparsity: float,
                            layer_formats: dict[str, str]) -> dict:
        return LeapSparseSettings(fmt=self.name, sparsity=sparsity, ignore=tuple(ignore)).to_config()

    def check_compute(self, manifest: dict, tensors: dict, layers: dict[str, torch.Tensor], report: Report,
                      options: ValidateOptions) -> None:
        """serving's CPU ops on each layer against the dense masked matmul in the same dtype: the decode op
        and the native kernel on each instruction set this CPU runs (when it can be built here)."""
        try:
            from serving.sparse_linear import BitmapWeight, bitmap_linear
        except ImportError as exc:
            report.add("sparse-linear", "all layers", None, f"serving.sparse_linear is not importable: {exc}")
            return
        paths = compute_paths(report, "bitmap_linear")
        gen = torch.Generator().manual_seed(options.seed)
        for layer, weight in layers.items():
            parts = self.layer_tensors(layer, manifest["layers"][layer], tensors)
            stored = BitmapWeight.from_tensors(self.name, parts)
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
                worst = max(errors.values())
                report.add("sparse-linear", layer, True,
                           f"max |difference| {worst:.3g} ({weight.dtype}; {', '.join(paths)})")


register(LeapSparseExporter(
    "bitmap", "The serving checkpoint `leapctl serve` loads: per pruned linear X, `X.shape`, `X.bitmap` "
              "(uint8 [rows, ceil(cols/8)], little-endian bits), `X.values` (kept values, row-major) and "
              "`X.row_offsets` (int64, first value of each row). 1.125 bytes per weight for 16-bit "
              "models at 50% sparsity."))
register(LeapSparseExporter(
    "csr", "Also servable: `X.shape`, `X.values`, `X.col_indices` (int32), `X.row_ptr` (int64 [rows+1])."))
