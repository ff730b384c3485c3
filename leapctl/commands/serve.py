"""`leapctl serve EXPORT_DIR [options] [-- extra vLLM arguments]`."""

from pathlib import Path

import typer

from leapctl.cli import app


@app.command(context_settings={"allow_extra_args": True})
def serve(
    ctx: typer.Context,
    export_dir: Path = typer.Argument(..., help="A bitmap or csr serving checkpoint from `leapctl export`."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on (0.0.0.0 inside a container)."),
    port: int = typer.Option(8000, min=1, max=65535, help="Port to listen on."),
    api_key: str = typer.Option(None, envvar="LEAPCTL_API_KEY",
                                help="Require this key (Authorization: Bearer KEY) on /v1 requests. Prefer "
                                     "the LEAPCTL_API_KEY variable: a command line is visible to every "
                                     "local user (ps); vLLM gets the key through its environment."),
    tensor_parallel_size: int = typer.Option(1, "--tensor-parallel-size", "-tp", min=1,
                                             help="Number of tensor-parallel ranks."),
) -> None:
    """Serve a sparse export with vLLM's OpenAI-compatible API (arguments after `--` go to vLLM)."""
    from leapctl.serve import serve as run_server

    raise typer.Exit(run_server(export_dir, host=host, port=port, api_key=api_key,
                                tensor_parallel_size=tensor_parallel_size, extra_args=list(ctx.args)))
