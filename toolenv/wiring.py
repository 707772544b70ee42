"""The one place the services meet: `toolenv serve` builds the in-process apps the gateway mounts.

The config file is read once (`read_all_sections`, which refuses a section no service reads);
each service gets its own section through its own settings class. Only the apps an embedded
tool of the table needs are built: sandboxd for an embedded sandbox tool, the emulators (one app
for search and reward) for either of those. A custom tool (`app: "module:factory"`) is left to
the gateway, which imports its factory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import typer
from fastapi import FastAPI
from pydantic import ValidationError

from emulators.app import create_app as create_emulators_app
from emulators.settings import EmulatorSettings
from gateway.app import create_app as create_gateway_app
from gateway.asgi import ASGIApp
from gateway.cli import run as run_gateway
from gateway.settings import BUILTIN_MOUNT, GatewaySettings
from sandboxd.app import create_app as create_sandbox_app
from sandboxd.settings import SandboxSettings
from toolenv_core.cli_options import RAY_ADDRESS_HELP, ConfigFileOption, ray_address
from toolenv_core.config import ConfigFileError, config_error

from .sections import read_all_sections, with_sandbox_defaults

# The packages whose apps `toolenv serve` may run in the gateway's process: their loggers (each
# named after its module) log as the gateway's JSON lines.
EMBEDDED_LOGGERS = ("sandboxd", "emulators")


def build_mounts(settings: GatewaySettings, sections: Mapping[str, Any]) -> dict[str, ASGIApp]:
    """The built-in in-process apps the gateway's embedded tools need, each built once."""
    wanted = {
        tool.mount for tool in settings.tool_table() if tool.mode == "embedded" and tool.app is None
    }
    mounts: dict[str, ASGIApp] = {}
    if BUILTIN_MOUNT["sandbox"] in wanted:
        mounts[BUILTIN_MOUNT["sandbox"]] = create_sandbox_app(
            SandboxSettings.from_sections(sections)
        )
    if BUILTIN_MOUNT["search"] in wanted:
        mounts[BUILTIN_MOUNT["search"]] = create_emulators_app(
            EmulatorSettings.from_sections(sections)
        )
    return mounts


def build_gateway(settings: GatewaySettings, sections: Mapping[str, Any]) -> FastAPI:
    """The gateway app with every embedded tool's app built and handed to it."""
    settings = with_sandbox_defaults(settings, sections)
    return create_gateway_app(settings, mounts=build_mounts(settings, sections))


def serve(
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port to bind (default 8080).")] = None,
    config: ConfigFileOption = None,
    mode: Annotated[
        str | None,
        typer.Option(
            help="embedded | proxy: force every tool into this mode (default: as configured)."
        ),
    ] = None,
    allow_unauthenticated: Annotated[
        bool,
        typer.Option("--allow-unauthenticated", help="Allow a non-loopback bind without API keys."),
    ] = False,
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray",
            help="Serve on Ray: the gateway, sandboxd and the emulators as Serve deployments. "
            f"{RAY_ADDRESS_HELP} The gateway replicas bind the ray section's http_host:http_port "
            "(--host and --port override). See docs/ray.md.",
            metavar="ADDRESS",
            callback=ray_address,
        ),
    ] = None,
    detach: Annotated[
        bool, typer.Option("--detach", help="With --ray: deploy, then exit and leave it running.")
    ] = False,
    ready_timeout: Annotated[
        float,
        typer.Option(
            min=1,
            help="With --ray: seconds the deployments may take to run, and /readyz to answer.",
        ),
    ] = 300.0,
) -> None:
    """Run the gateway (with no config: sandbox, search and reward mounted in-process).

    `toolenv gateway serve --mode proxy --config FILE` is what compose runs. API keys come from
    the environment (`TOOLENV_GATEWAY_API_KEYS`, comma-separated) or the config file, never from
    the command line, where `ps` would show them.
    """
    if ray_address is not None and mode is not None:  # it was ignored without a word
        raise typer.BadParameter(
            "places the tools of a gateway on this machine; with --ray each tool is a Serve "
            "deployment (the ray section sizes them)",
            param_hint="--mode",
        )
    if ray_address is not None:
        # Ray is an optional extra (`pip install toolenv[ray]`): imported only when asked for.
        try:
            from toolenv.ray.cli import run_on_ray
        except ImportError as exc:
            typer.echo(
                f"error: --ray needs Ray Serve: pip install 'toolenv[ray]' ({exc})", err=True
            )
            raise typer.Exit(2) from exc
        run_on_ray(
            ray_address,
            str(config) if config else None,
            (host, port),
            allow_unauthenticated,
            detach,
            ready_timeout_s=ready_timeout,
        )
        return
    if mode is not None and mode not in ("embedded", "proxy"):
        raise typer.BadParameter("must be embedded or proxy", param_hint="--mode")
    overrides: dict[str, Any] = {
        k: v for k, v in {"host": host, "port": port, "mode": mode}.items() if v is not None
    }
    if allow_unauthenticated:
        overrides["allow_unauthenticated"] = True
    try:
        sections = read_all_sections(config)
        settings = GatewaySettings.from_sections(sections, **overrides)
        settings.check_bind()
        app = build_gateway(settings, sections)
    except (ConfigFileError, ValidationError, ValueError) as exc:
        typer.echo(f"error: {config_error(exc)}", err=True)
        raise typer.Exit(2) from exc
    run_gateway(app, settings, also_log=EMBEDDED_LOGGERS)
