"""Export targets, one module each, registered by name (as vLLM registers quantization methods):
`leap_sparse` (bitmap, csr), `bitmap_q4`, `tiled` (tiled-csl, tiled-bitmap), `compressed_tensors` and `onnx`.
`get_exporter(name)` is what `leapctl export` and `leapctl validate` use."""

from leapctl.errors import LeapctlError
from leapctl.exporters import bitmap_q4, compressed_tensors, leap_sparse, onnx, tiled  # noqa: F401  (registration)
from leapctl.exporters.base import EXPORTERS, Exporter, register


def exporter_names() -> list[str]:
    return list(EXPORTERS)


def get_exporter(name: str) -> Exporter:
    if name not in EXPORTERS:
        raise LeapctlError(f"unknown export format {name!r} (choose from {', '.join(EXPORTERS)})")
    return EXPORTERS[name]


__all__ = ["EXPORTERS", "Exporter", "exporter_names", "get_exporter", "register"]
