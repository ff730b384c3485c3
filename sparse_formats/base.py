"""The contract every sparse format keeps, and the registry that names them.

A format turns a dense weight and a boolean keep-mask into a dict of named tensors (always including
`shape`, int64[2]) and back. Decoding returns the masked dense weight bit for bit; `check` raises
`FormatError` naming what is inconsistent; `nbytes` counts what the encoded tensors occupy."""

from typing import Protocol

import torch


class SparseFormat(Protocol):
    name: str
    lossless: bool  # decode(encode(w, m)) == w * m bit for bit; False for quantized formats (bitmap-q4)

    def encode(self, weight: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """Encode `weight * mask` (mask: bool, same shape as the 2-D weight)."""
        ...

    def decode(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """The dense masked weight, in the dtype of the stored values."""
        ...

    def check(self, tensors: dict[str, torch.Tensor]) -> None:
        """Raise `FormatError` if the tensors are not a consistent encoding."""
        ...


FORMATS: dict[str, SparseFormat] = {}


def register(fmt: SparseFormat) -> SparseFormat:
    FORMATS[fmt.name] = fmt
    return fmt


def get_format(name: str) -> SparseFormat:
    if name not in FORMATS:
        raise KeyError(f"unknown sparse format {name!r} (known: {', '.join(sorted(FORMATS))})")
    return FORMATS[name]


def lossless_formats() -> list[str]:
    """Names of the formats whose round trip is exact for any weight, mask, shape and dtype."""
    return sorted(name for name, fmt in FORMATS.items() if fmt.lossless)


def nbytes(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes the encoded tensors occupy, `shape` included."""
    return sum(t.numel() * t.element_size() for t in tensors.values())
