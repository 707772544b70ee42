"""`create_app(settings)`: sandboxd as a standalone FastAPI app (also what the gateway mounts)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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
    app.state.sandbox_service = service
    app.include_router(build_router(service))
    # A request body is bounded as the router reads it: a Content-Length over the limit is a 413
    # before any of it is read, a body not whole within body_timeout_s a 408 that closes the
    # connection (it held the connection unanswered). Mounted in the gateway, its door bounds bodies first.
    app.add_middleware(
        BodyLimit, max_body_bytes=settings.max_body_bytes, body_timeout_s=settings.body_timeout_s
    )
    return app


class AnswerCutCalls:
    """`sandboxd serve`'s outermost layer: a call still running `shutdown_grace_s` after SIGTERM
    or SIGINT is cancelled by uvicorn (its run is killed and cleaned up as a cancelled one's);
    it is answered 503 saying so, where uvicorn answered its own plain-text 500."""

    def __init__(self, app: ASGIApp, grace_s: float) -> None:
        self.app = app
        self.body = json.dumps(
            {
                "detail": "sandboxd stopped before this call finished: calls in flight get "
                f"shutdown_grace_s ({grace_s:g} s) after SIGTERM/SIGINT, then are cut; send it "
                "again once sandboxd is back (or to another one)"
            }
        ).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except asyncio.CancelledError:
            if scope["type"] == "http" and not started:
                headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
                await send({"type": "http.response.start", "status": 503, "headers": headers})
                await send({"type": "http.response.body", "body": self.body})
            raise
