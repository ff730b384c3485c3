"""`leapctl eval`."""

from leapctl.cli import app  # noqa: F401
