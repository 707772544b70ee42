"""The gateway's ASGI application: built from settings, with everything it owns in its lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from toolenv import __version__

from .settings import GatewaySettings


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings.load()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False

    app = FastAPI(title="toolenv gateway", version=__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.ready = False

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"])
    async def readyz() -> dict[str, object]:
        """Readiness: start-up finished and every tool can take calls."""
        return {"status": "ready" if app.state.ready else "starting"}

    return app
