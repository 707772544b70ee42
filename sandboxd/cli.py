"""sandboxd subcommands."""

from __future__ import annotations

import typer

app = typer.Typer(help="sandboxd commands.", no_args_is_help=True)


@app.command("settings")
def show_settings() -> None:
    """Print this service's effective settings as JSON."""
    from .settings import SandboxSettings as S

    typer.echo(S.load().model_dump_json(indent=2))
