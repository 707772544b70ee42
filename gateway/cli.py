"""Gateway subcommands: `toolenv serve` (the embedded service)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(root: typer.Typer) -> None:
    root.command("serve")(serve)


def serve(
    host: Annotated[str | None, typer.Option(help="Address to bind (default 127.0.0.1).")] = None,
    port: Annotated[int | None, typer.Option(help="Port to bind (default 8080).")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="Config file (YAML/TOML/JSON).")] = None,
) -> None:
    """Run the embedded service: the gateway with the tools mounted in-process."""
    import uvicorn

    from .app import create_app
    from .settings import GatewaySettings

    overrides = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
    settings = GatewaySettings.load(config, **overrides)
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
