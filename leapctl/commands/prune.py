"""`leapctl prune`."""

from leapctl.cli import app  # noqa: F401
