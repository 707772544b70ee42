"""Gateway subcommands: `toolenv serve` (embedded by default) and `toolenv gateway serve`.

API keys come from the environment only (`TOOLENV_GATEWAY_API_KEYS`, comma-separated) or the
config file, never from the command line, where `ps` would show them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

gateway_app = typer.Typer(help="The gateway: one front door for every tool.", no_args_is_help=True)


def register(root: typer.Typer) -> None:
    root.command("serve")(serve)
    gateway_app.command("serve")(gateway_serve)
    gateway_app.command("trace-to-multiturn")(trace_to_multiturn)
    root.add_typer(gateway_app, name="gateway")


Mode = Literal["embedded", "proxy"]


def serve(
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port to bind (default 8080).")] = None,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="Config file (YAML/TOML/JSON).")
    ] = None,
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
) -> None:
    """Run the gateway (with no config: sandbox, search and reward mounted in-process)."""
    run_gateway(host, port, config, mode, allow_unauthenticated)


def gateway_serve(
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port to bind (default 8080).")] = None,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="Config file (YAML/TOML/JSON).")
    ] = None,
    mode: Annotated[
        str | None, typer.Option(help="embedded | proxy (default: as configured).")
    ] = None,
    allow_unauthenticated: Annotated[
        bool,
        typer.Option("--allow-unauthenticated", help="Allow a non-loopback bind without API keys."),
    ] = False,
) -> None:
    """Run the gateway; `--mode proxy --config FILE` is what compose runs."""
    run_gateway(host, port, config, mode, allow_unauthenticated)


def run_gateway(
    host: str | None,
    port: int | None,
    config: Path | None,
    mode: str | None,
    allow_unauthenticated: bool,
) -> None:
    import uvicorn
    from pydantic import ValidationError

    from toolenv_core.config import ConfigFileError

    from .app import create_app
    from .logs import setup_logging
    from .settings import GatewaySettings

    if mode is not None and mode not in ("embedded", "proxy"):
        raise typer.BadParameter("must be embedded or proxy", param_hint="--mode")
    overrides = {
        k: v for k, v in {"host": host, "port": port, "mode": mode}.items() if v is not None
    }
    if allow_unauthenticated:
        overrides["allow_unauthenticated"] = True
    try:
        settings = GatewaySettings.load(config, **overrides)
        settings.check_bind()
    except (ConfigFileError, ValidationError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    setup_logging(settings.log_level)
    uvicorn.run(
        create_app(settings, config_file=str(config) if config else None),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        lifespan="on",
        access_log=False,
        proxy_headers=False,  # X-Forwarded-* are not trusted: the caller is the socket's peer
        backlog=settings.backlog,
        timeout_graceful_shutdown=5,
    )


def trace_to_multiturn(
    capture: Annotated[Path, typer.Argument(help="JSONL written by the gateway's trace capture.")],
    out: Annotated[Path, typer.Argument(help="PolyTrace multi-turn JSONL to write.")],
) -> None:
    """Group captured tool calls per trajectory into PolyTrace multi-turn records (for the emulators)."""
    from .trace import to_multiturn

    if not capture.is_file():
        typer.echo(f"error: {capture} does not exist", err=True)
        raise typer.Exit(2)
    count = to_multiturn(capture, out)
    typer.echo(f"wrote {count} trajectories to {out}")
