"""The `leapctl` command line: a thin layer over the library functions.

Each command lives in `leapctl/commands/<name>.py` (see `leapctl.commands`); `COMMANDS` below is the one
list of them, registered on `app` here. Errors the user can fix (`LeapctlError`) become one line on
stderr and exit status 2, never a traceback."""

import os
import sys

import typer

from leapctl.commands import (
    apply_mask,
    compress,
    eval,
    export,
    learn,
    prune,
    quantize,
    recover,
    serve,
    validate,
)
from leapctl.errors import LeapctlError
from leapctl.settings import config_command

# In the order `leapctl --help` lists them: the main path first.
COMMANDS = (compress, prune, learn, recover, apply_mask, quantize, eval, export, validate, serve)

app = typer.Typer(
    name="leapctl",
    help="Prune LLMs to 50-60% unstructured sparsity (LEAP, Wanda, SparseGPT), export and serve them.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        from leapctl import __version__

        typer.echo(f"leapctl {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True,
                                 callback=_print_version),
) -> None:
    """Options that apply before any command."""


def _register(command) -> None:
    config_command(app, command.Config, command.main, name=command.NAME, help=command.HELP,
                   **getattr(command, "CLI", {}))


for _command in COMMANDS:
    _register(_command)


def fail(message: str) -> None:
    """Print one error line and exit 2; for callers outside the normal command flow."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _quiet_libraries() -> None:
    """Loading-progress bars and warnings from transformers and the hub would bury our own output and
    break the one-line error rule; leapctl shows its own progress."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def main() -> None:
    _quiet_libraries()

    # Standalone mode: typer reports its own usage errors (exit 2) and interrupts; a LeapctlError is not
    # a click exception, so it passes through to here and becomes one line.
    try:
        app(prog_name="leapctl")
    except LeapctlError as exc:
        fail(str(exc))


if __name__ == "__main__":
    main()
