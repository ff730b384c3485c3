"""`leapctl apply-mask`."""

from leapctl.cli import app  # noqa: F401
