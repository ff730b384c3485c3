"""Sparse weight formats with exact round trips and integrity checks; torch and numpy only, no model
knowledge.

Formats register themselves on import: `get_format("bitmap").encode(weight, mask)`."""

from sparse_formats import bitmap, bitmap_q4, csr, int8_rows, tiled_bitmap, tiled_csl  # noqa: F401  (registration)
from sparse_formats.base import FORMATS, SparseFormat, get_format, lossless_formats, nbytes, register
from sparse_formats.bitpack import pack_rows, packed_cols, unpack_rows
from sparse_formats.errors import FormatError

__all__ = ["FORMATS", "FormatError", "SparseFormat", "get_format", "lossless_formats", "nbytes", "pack_rows",
           "packed_cols", "register", "unpack_rows"]
