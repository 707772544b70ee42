"""`create_app(settings)`: sandboxd as a standalone FastAPI app (also what the gateway mounts)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException

from toolenv_core.allow import http_error
from toolenv_core.bodylimit import BodyLimit
from toolenv_core.heap import freeze_startup_objects

from .api import build_router
from .service import SandboxService
from .settings import SandboxSettings


def create_app(settings: SandboxSettings | None = None) -> FastAPI:
    """The app's lifespan starts the backend (check bwrap, warm pools) and closes it on exit."""
    settings = settings or SandboxSettings.load()
    service = SandboxService(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        freeze_startup_objects()
        try:
            yield
        finally:
            await service.close()

    app = FastAPIOffline(  # /docs serves its own Swagger UI assets: works offline
        title="toolenv sandboxd",
        description="Code-execution sandboxes, SandboxFusion-compatible `/run_code`.",
        lifespan=lifespan,
    )
    app.add_exception_handler(HTTPException, http_error)  # a 405's Allow names every method
    app.state.sandbox_service = service
    app.include_router(build_router(service))
    # A request body is bounded as the router reads it: a Content-Length over the limit is a 413
    # before any of it is read, a body not whole within body_timeout_s a 408 that closes the
    # connection (it held the connection unanswered). Mounted in the gateway, its door bounds bodies first.
    app.add_middleware(
        BodyLimit, max_body_bytes=settings.max_body_bytes, body_timeout_s=settings.body_timeout_s
    )
    return app
