"""`int8-rows`: a dense weight as 8-bit codes with one scale per row, for the layers a sparse model keeps
whole but should not read in 16 bits (lm_head: 28M of SmolLM2-135M's 134M weights).

A weight is `scale * code` with `code` in -127..127 (symmetric; -128 unused so that the grid is its own
negation) and `scale` one fp16 per row: the row's largest |w| maps to 127. Per row, not per group, because
the served op (vLLM's oneDNN int8 GEMM on CPU) takes one weight scale per output channel; on SmolLM2's
lm_head that costs +0.1% perplexity against the dense head (`python -m bench.quality head`).

Tensors for a [rows, cols] weight:
- `shape`: int64[2].
- `qweight`: int8 [rows, cols].
- `scales`: fp16 [rows].

1 + 2/cols bytes per weight (1.003 for SmolLM2's 576 columns), half of a 16-bit weight."""

import torch

from sparse_formats.base import register
from sparse_formats.checks import check_encode_inputs, first_index, read_shape, require, shape_tensor
from sparse_formats.errors import FormatError

LIMIT = 127
FP16_MAX = 65504.0
FP16_TINY = 2.0**-24  # the smallest positive fp16; a row of zeros gets it (any code decodes to 0 there)


def row_scales(weight: torch.Tensor) -> torch.Tensor:
    """fp16 [rows]: each row's largest |w| over 127, rounded to fp16 (at least its smallest subnormal)."""
    top = weight.float().abs().amax(dim=1)
    if bool((top / LIMIT > FP16_MAX).any()):
        raise ValueError(f"a weight of {float(top.max()):.3g} needs a scale beyond fp16's range")
    return (top / LIMIT).clamp_min(FP16_TINY).to(torch.float16)


def quantize_codes(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 [rows, cols]: the nearest code of every weight under `scales` (ties to even)."""
    return torch.round(weight.float() / scales.float().unsqueeze(1)).clamp_(-LIMIT, LIMIT).to(torch.int8)


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [rows, cols]: scale * code; exact (an fp16 scale times an 8-bit integer needs 19 bits)."""
    return codes.float() * scales.float().unsqueeze(1)


class Int8RowsFormat:
    name = "int8-rows"
    lossless = False  # values are rounded to the grid; round trips are exact for codes and scales

    def encode(self, weight: torch.Tensor, mask: torch.Tensor | None = None,
               scales: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Every weight on the nearest code (a mask, if given, must keep everything: the format is dense).
        With `scales` (fp16 [rows]) the weights must already lie on that grid (a quantized run folder):
        ValueError names the first one that does not, so an export can never differ from its run."""
        if mask is None:
            mask = torch.ones(weight.shape, dtype=torch.bool)
        check_encode_inputs(weight, mask)
        if not bool(mask.all()):
            raise ValueError(f"{self.name} stores every weight, but the mask prunes {int((~mask).sum())}")
        rows = weight.shape[0]
        given = scales is not None
        if scales is None:
            scales = row_scales(weight)
        elif scales.reshape(-1).shape != (rows,):
            raise ValueError(f"scales have shape {tuple(scales.shape)}, expected [{rows}]")
        scales = scales.reshape(rows).to(torch.float16).contiguous()
        codes = quantize_codes(weight, scales)
        if given:
            off = dequantize(codes, scales) != weight.float()
            if bool(off.any()):
                row, col = (int(i) for i in off.nonzero()[0])
                raise ValueError(f"weight [{row}, {col}] = {float(weight[row, col])!r} is not on the 8-bit "
                                 f"grid of its row's scale {float(scales[row])!r}")
        return {"shape": shape_tensor(weight), "qweight": codes.contiguous(),
                "scales": scales}

    def decode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The dequantized weight in fp32."""
        return dequantize(tensors["qweight"], tensors["scales"])

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        rows, cols = read_shape(tensors, self.name)
        codes = require(tensors, self.name, "qweight", torch.int8, 2)
        scales = require(tensors, self.name, "scales", torch.float16, 1)
        if tuple(codes.shape) != (rows, cols):
            raise FormatError(f"{self.name}: qweight has shape {tuple(codes.shape)}, the shape says "
                              f"{(rows, cols)}")
        if scales.numel() != rows:
            raise FormatError(f"{self.name}: scales has {scales.numel()} entries, expected one per row "
                              f"({rows})")
        bad = ~torch.isfinite(scales) | (scales <= 0)
        if bool(bad.any()):
            row = first_index(bad)
            raise FormatError(f"{self.name}: scales[{row}] is {float(scales[row])!r}, not a positive finite "
                              f"scale")
        if bool((codes == -LIMIT - 1).any()):
            row = first_index((codes == -LIMIT - 1).any(dim=1))
            raise FormatError(f"{self.name}: qweight row {row} holds -128, outside the grid's -127..127")


INT8_ROWS = register(Int8RowsFormat())
