"""rollout_client subcommands."""

from __future__ import annotations

import typer

app = typer.Typer(help="rollout_client commands.", no_args_is_help=True)


@app.command("settings")
def show_settings() -> None:
    """Print this service's effective settings as JSON."""
    from .settings import RolloutSettings as S

    typer.echo(S.load().model_dump_json(indent=2))


def register_stress(root: typer.Typer) -> None:
    """`toolenv stress` lives with the rollout client (it drives tool endpoints the same way)."""
    from rollout_client.stress.cli import stress

    root.command("stress")(stress)
