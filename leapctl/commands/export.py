"""`leapctl export`."""

from leapctl.cli import app  # noqa: F401
