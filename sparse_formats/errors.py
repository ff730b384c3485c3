"""Errors raised by format checks; the message names what is wrong."""


class FormatError(ValueError):
    """Encoded sparse data is inconsistent (lengths, offsets, positions, counts)."""
