"""The `toolenv` command's root typer app, built by `build_app()` (which `toolenv.entry` runs),
that mounts each service's own subcommands. Building it imports the services; importing this
module registers nothing."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from emulators.cli import app as emulators_app
from gateway.cli import build_cli as build_gateway_cli
from rollout_client.cli import app as rollout_app
from sandboxd.cli import app as sandboxd_app
from stress.cli import stress
from toolenv_core import __version__
from toolenv_core.cli_options import ConfigFileOption
from toolenv_core.config import ConfigFileError, config_error
from toolenv_core.console import report_console

from .sections import SETTINGS_CLASSES, read_all_sections, with_sandbox_defaults
from .traces import app as traces_app
from .wiring import serve


def _version(value: bool) -> None:
    if value:
        typer.echo(f"toolenv {__version__}")
        raise typer.Exit()


def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """toolenv: a warm sandbox pool, latency-replaying tool emulators, one gateway, and a rollout client."""


def config_show(
    config: ConfigFileOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")] = False,
) -> None:
    """Print the effective settings of every service (defaults < file < TOOLENV_* env vars)."""
    try:
        sections = read_all_sections(config)
        built = {section: cls.from_sections(sections) for section, cls in SETTINGS_CLASSES.items()}
        # an embedded sandbox tool's default timeouts are the sandbox section's, as `serve` runs it
        built["gateway"] = with_sandbox_defaults(built["gateway"], sections)
        effective = {section: values.model_dump(mode="json") for section, values in built.items()}
    except (ConfigFileError, ValueError) as exc:
        typer.echo(f"error: {config_error(exc)}", err=True)
        raise typer.Exit(2) from exc
    if as_json:
        typer.echo(json.dumps(effective, indent=2))
        return
    console = report_console()
    for section, values in effective.items():
        # escaped: rich read `[gateway]` as a markup tag and printed the title without it; as
        # wide as the title at least, which a narrow table wrapped
        title = f"[{section}]  env prefix TOOLENV_{section.upper()}_"
        table = Table(title=escape(title), title_justify="left", min_width=len(title))
        table.add_column("setting")
        table.add_column("value")
        for key, value in values.items():
            table.add_row(key, escape(value if isinstance(value, str) else json.dumps(value)))
        console.print(table)


def build_app() -> typer.Typer:
    """The root command with every service's subcommands mounted (built on demand, not at import)."""
    app = typer.Typer(
        name="toolenv",
        help="Tool environments for RL on tool use: sandboxes, emulators, gateway, rollouts.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    app.callback()(root)
    config_app = typer.Typer(help="Inspect the effective configuration.", no_args_is_help=True)
    config_app.command("show")(config_show)
    app.add_typer(config_app, name="config")
    app.command("serve")(serve)
    gateway = build_gateway_cli()
    gateway.command("serve")(serve)  # what compose runs: `--mode proxy --config FILE`
    app.add_typer(gateway, name="gateway")
    app.add_typer(sandboxd_app, name="sandboxd")
    app.add_typer(emulators_app, name="emulators")
    app.add_typer(rollout_app, name="rollout")
    app.command("stress")(stress)
    app.add_typer(traces_app, name="traces")
    return app
