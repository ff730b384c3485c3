"""Importing this package registers every command on `leapctl.cli.app`; one module per command."""

from leapctl.commands import (  # noqa: F401
    apply_mask,
    eval,
    export,
    learn,
    prune,
    quantize,
    serve,
    validate,
)
