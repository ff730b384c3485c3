"""`leapctl learn`."""

from leapctl.cli import app  # noqa: F401
