"""The `nanovllm` command line. It talks to the engine only through its public Python API.

Each command lives in its own module; register a new one here with one import and one `app.command` line.
"""
from __future__ import annotations

from importlib.metadata import version
from typing import Annotated

import typer
from typer.core import TyperCommand, TyperGroup

from nanovllm_cli.bench import bench
from nanovllm_cli.inspect_cache import inspect_cache
from nanovllm_cli.run_cmd import run


def _flags_without_type(params: list) -> list:
    """A flag takes no value: its --help line shows none (Typer would write `<bool>` where a value's type goes)."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class Command(TyperCommand):
    def get_params(self, ctx) -> list:
        return _flags_without_type(super().get_params(ctx))


class Group(TyperGroup):
    def get_params(self, ctx) -> list:
        return _flags_without_type(super().get_params(ctx))


app = typer.Typer(cls=Group, no_args_is_help=True, rich_markup_mode="markdown", pretty_exceptions_show_locals=False,
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


app.command("run", cls=Command)(run)
app.command("inspect-cache", cls=Command)(inspect_cache)
app.command("bench", cls=Command)(bench)
