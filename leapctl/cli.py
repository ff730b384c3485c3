"""The `leapctl` command line: a thin layer over the library functions.

Each command lives in `leapctl/commands/<name>.py` (see `leapctl.commands`); `COMMANDS` below is the one
list of them, registered on `app` here. `main` is the one error boundary: errors the user can fix
(`LeapctlError`) and usage errors become one line on stderr and exit status 2; anything unexpected becomes
one line naming the command and the file its traceback was written to, exit status 1. Never a traceback."""

import importlib
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

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
from leapctl.errors import LeapctlError, one_line
from leapctl.outdir import exit_zero_once_written
from leapctl.settings import config_command

# Click's exception classes as typer raises them: typer >= 0.22 carries its own copy of click (typer._click),
# older versions use click itself; the module that defines typer.BadParameter is the right one either way.
click_errors = importlib.import_module(typer.BadParameter.__module__)

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


def _command_name(args: list[str]) -> str:
    """The command the arguments name (`leapctl` when none): the first argument that is a command."""
    names = {command.NAME for command in COMMANDS}
    return next((f"leapctl {arg}" for arg in args if arg in names), "leapctl")


def _usage_line(exc: Exception) -> str:
    """Click's usage error (typer draws it as a 5-6 line box) as one line, with where to read more."""
    context = exc.ctx.command_path if exc.ctx is not None else "leapctl"
    return f"{context}: {exc.format_message()} (see `{context} --help`)"


def write_traceback(command: str) -> Path:
    """Write the exception being handled, with the command and leapctl's version, to a new file under the
    cache (the temporary folder if the cache cannot be written); returns its path."""
    from leapctl import __version__
    from leapctl.paths import cache_dir

    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    text = f"{command} (leapctl {__version__}, {stamp})\n{traceback.format_exc()}"
    prefix = f"{command.replace(' ', '-')}-{time.strftime('%Y%m%d-%H%M%S')}-"
    try:
        folder = cache_dir() / "tracebacks"
        folder.mkdir(exist_ok=True)
    except OSError:
        folder = Path(tempfile.gettempdir())
    handle, name = tempfile.mkstemp(prefix=prefix, suffix=".txt", dir=folder)
    with os.fdopen(handle, "w", encoding="utf-8") as file:
        file.write(text)
    return Path(name)


def main() -> None:
    """The entry point and the CLI's one error boundary (see the module docstring)."""
    _quiet_libraries()
    exit_zero_once_written()
    try:
        status = app(prog_name="leapctl", standalone_mode=False)
    except click_errors.UsageError as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # `leapctl` alone: the help, as a usage error
            exc.show()
            sys.exit(exc.exit_code)
        fail(_usage_line(exc))
    except click_errors.ClickException as exc:
        fail(exc.format_message())
    except typer.Abort:  # end of input at a prompt
        sys.exit(130)
    except LeapctlError as exc:
        fail(str(exc))
    except Exception as exc:
        command = _command_name(sys.argv[1:])
        where = write_traceback(command)
        print(f"error: {command} failed unexpectedly ({type(exc).__name__}: {one_line(exc)}); "
              f"the traceback is in {where}", file=sys.stderr)
        sys.exit(1)
    sys.exit(status if isinstance(status, int) else 0)


if __name__ == "__main__":
    main()
