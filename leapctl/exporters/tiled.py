"""`tiled-csl` and `tiled-bitmap`: GPU kernel layouts (Flash-LLM's Tiled-CSL; our tiled bitmap that the
Triton kernel streams), one set of tensors per pruned layer in a Hugging Face checkpoint. They carry the
`leap_sparse` method name for the tools that read them; `leapctl serve` does not load them."""

from leapctl.exporters.base import register
from leapctl.exporters.checkpoint import SparseCheckpointExporter
from leapctl.runs import Run
from serving.contract import LeapSparseSettings
from sparse_formats.tiled_csl import VALUE_DTYPES as TILED_CSL_DTYPES


class TiledExporter(SparseCheckpointExporter):
    def __init__(self, fmt: str, summary: str, value_dtypes: tuple = ()):
        self.name = self.codec_name = fmt
        self.summary = summary
        self.value_dtypes = value_dtypes

    def quantization_config(self, source: Run, ignore: list[str], sparsity: float,
                            layer_formats: dict[str, str]) -> dict:
        return LeapSparseSettings(fmt=self.name, sparsity=sparsity, ignore=tuple(ignore)).to_config()


register(TiledExporter(
    "tiled-csl", "Flash-LLM's Tiled-CSL: 128x64 tiles, one 32-bit word per kept weight (16-bit value + "
                 "position). 16-bit values: fp32 models are cast to float16 unless --dtype says bfloat16.",
    TILED_CSL_DTYPES))
register(TiledExporter(
    "tiled-bitmap", "The GPU kernel's layout: 64x64 groups, one 64-bit bitmap word per group row, values "
                    "contiguous per group, int64 group offsets."))
