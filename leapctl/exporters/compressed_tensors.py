"""`compressed-tensors`: llm-compressor's `sparse-bitmask` layout (`X.shape`, `X.compressed`, `X.bitmask`,
`X.row_offsets`) with the `sparsity_config` compressed-tensors describes, for tools that read it. Stock
vLLM refuses sparsity configs (facts.md), so nothing here serves it."""

from leapctl.exporters.base import register
from leapctl.exporters.checkpoint import SparseCheckpointExporter
from leapctl.runs import Run


class CompressedTensorsExporter(SparseCheckpointExporter):
    name = "compressed-tensors"
    summary = ("llm-compressor's sparse-bitmask layout (`X.shape`, `X.compressed`, `X.bitmask`, "
               "`X.row_offsets`) with `quantization_config.sparsity_config`. Stock vLLM refuses sparsity "
               "configs.")
    codec_name = "bitmap"
    stored_names = {"bitmap": "bitmask", "values": "compressed"}

    def quantization_config(self, source: Run, ignore: list[str], sparsity: float,
                            layer_formats: dict[str, str]) -> dict:
        sparsity_config = {"format": "sparse-bitmask", "targets": ["Linear"], "ignore": ignore,
                           "global_sparsity": sparsity, "sparsity_structure": "unstructured"}
        try:
            import compressed_tensors
            from compressed_tensors.config import BitmaskConfig

            sparsity_config = BitmaskConfig(**sparsity_config).model_dump()
            version = compressed_tensors.__version__
        except ImportError:
            version = "unknown"
        return {"quant_method": "compressed-tensors", "format": "sparse-bitmask", "version": version,
                "sparsity_config": sparsity_config}


register(CompressedTensorsExporter())
