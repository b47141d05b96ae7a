"""The `nanovllm` command line. It talks to the engine only through its public Python API.

Each command lives in its own module; register a new one here with one import and one `app.command` line.
"""
from __future__ import annotations

from importlib.metadata import version
from typing import Annotated

import typer

from nanovllm_cli.bench import bench
from nanovllm_cli.inspect_cache import inspect_cache
from nanovllm_cli.run_cmd import run

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown",
                  pretty_exceptions_show_locals=False,
                  help="nanovllm: offline batch LLM inference. `nanovllm COMMAND --help` for each command.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"nanovllm {version('nanovllm')}")  # from the package metadata: no need to import torch
        raise typer.Exit()


@app.callback()
def main(
    show_version: Annotated[bool | None, typer.Option(
        "--version", help="Print the version and exit.", callback=_version, is_eager=True)] = None,
) -> None:
    """nanovllm: offline batch LLM inference."""


app.command("run")(run)
app.command("inspect-cache")(inspect_cache)
app.command("bench")(bench)
