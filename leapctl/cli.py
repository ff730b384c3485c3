"""The `leapctl` command line: a thin layer over the library functions.

Each command lives in `leapctl/commands/<name>.py` and registers itself on `app`. Errors the user
can fix (`LeapctlError`) become one line on stderr and exit status 2, never a traceback."""

import sys

import click
import typer

from leapctl.errors import LeapctlError

app = typer.Typer(
    name="leapctl",
    help="Prune LLMs to 50-60% unstructured sparsity (LEAP, Wanda, SparseGPT), export and serve them.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", is_eager=True),
) -> None:
    if version:
        from leapctl import __version__

        typer.echo(f"leapctl {__version__}")
        raise typer.Exit()


def fail(message: str) -> None:
    """Print one error line and exit 2; for callers outside the normal command flow."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    import leapctl.commands  # noqa: F401  (registers the commands on `app`)

    command = typer.main.get_command(app)
    try:
        rc = command.main(prog_name="leapctl", standalone_mode=False)
    except LeapctlError as exc:
        fail(str(exc))
    except click.exceptions.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
