"""`leapctl validate`."""

from leapctl.cli import app  # noqa: F401
