"""The `toolenv rollout` commands, one module each; this module only assembles them."""

from __future__ import annotations

import typer

from toolenv_core.cli_options import ConfigFileOption

from ..settings import RolloutSettings
from .calibrate_cmd import calibrate
from .common import fail, one_line
from .run_cmd import run
from .study_cmd import study
from .validate_cmd import validate

app = typer.Typer(
    help="Multi-turn rollouts through the gateway, with straggler policies.", no_args_is_help=True
)


def show_settings(
    config: ConfigFileOption = None,
) -> None:
    """Print this service's effective settings as JSON (what `--config FILE` would give)."""
    try:
        settings = RolloutSettings.load(config)
    except ValueError as exc:  # a ValidationError too
        fail(one_line(exc))
    typer.echo(settings.model_dump_json(indent=2))


app.command("settings")(show_settings)
app.command("run")(run)
app.command("study")(study)
app.command("validate")(validate)
app.command("calibrate")(calibrate)

__all__ = ["app"]
