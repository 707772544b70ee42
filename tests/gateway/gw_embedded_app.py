"""An in-process tool for embedded-mode tests: it records its lifespan and every cancellation.

The gateway mounts it by reference (`app: "gw_embedded_app:create_app"`: the extension point for
custom tools), through the same in-process path as sandboxd and the emulators, so these tests
exercise the real embedded path without a sandbox.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response

EVENTS: list[str] = []  # what the test inspects (this module lives only inside the test process)


def create_app() -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        EVENTS.append("startup")
        yield
        EVENTS.append("shutdown")

    app = FastAPI(lifespan=lifespan)

    @app.post("/call")
    @app.post("/retrieve")  # as a search tool's pass-through route reaches it
    async def call(request: Request) -> Any:
        body = await request.json()
        if body.get("raise"):
            raise RuntimeError("a bug inside the tool")
        if "status" in body:  # answers that status, whatever it is
            return Response(b"{}", status_code=body["status"], media_type="application/json")
        try:
            await asyncio.sleep(float(body.get("sleep_s", 0)))
        except asyncio.CancelledError:
            EVENTS.append(f"cancelled:{body.get('tag')}")
            raise
        return {
            "echo": body,
            "deadline_ms": request.headers.get("x-toolenv-deadline-ms"),
            "call_context": {
                k: request.headers.get(k) for k in ("x-trajectory-id", "x-step", "x-turn")
            },
        }

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app


def create_failing_app() -> FastAPI:
    """A tool whose start-up fails (its database is down, say)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        raise RuntimeError("the tool's database is down")
        yield

    app = FastAPI(lifespan=lifespan)

    @app.post("/call")
    async def call() -> dict[str, Any]:
        return {"served": "without its start-up"}

    return app


def no_app() -> None:
    """A factory that forgot its `return app`."""


def raising_factory() -> FastAPI:
    """A factory that fails before it has an app (its config is missing, say)."""
    raise RuntimeError("the tool's config file is missing")
