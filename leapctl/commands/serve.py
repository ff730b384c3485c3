"""`leapctl serve`."""

from leapctl.cli import app  # noqa: F401
