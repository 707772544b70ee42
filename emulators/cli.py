"""emulators subcommands."""

from __future__ import annotations

import typer

app = typer.Typer(help="emulators commands.", no_args_is_help=True)


@app.command("settings")
def show_settings() -> None:
    """Print this service's effective settings as JSON."""
    from .settings import EmulatorSettings as S

    typer.echo(S.load().model_dump_json(indent=2))
