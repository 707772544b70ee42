"""A direct lane for the hot endpoints, past FastAPI's per-request dependency machinery.

The emulators' call endpoints parse their own bodies and return ready responses, so FastAPI's
routing and dependency solving add nothing but CPU (about half of a call's cost in-process). The
same handler functions stay registered as FastAPI routes (OpenAPI, `/docs`); this middleware
sends matching requests straight to them. It sits inside Starlette's error middleware, so an
unexpected exception still becomes a 500, not a dropped connection.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

Handler = Callable[[Request], Awaitable[Response]]


class FastRouter(APIRouter):
    """An APIRouter that also keeps the handlers of its direct lane (see `FastPathMiddleware`)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fast_routes: dict[tuple[str, str], Handler] = {}

    def add_fast_route(self, method: str, path: str, handler: Handler, **route_kwargs: Any) -> None:
        """Add `handler` as a documented FastAPI route and as a direct-lane route."""
        self.add_api_route(path, handler, methods=[method], **route_kwargs)
        self.fast_routes[(method, path)] = handler


class FastPathMiddleware:
    def __init__(self, app: ASGIApp, routes: dict[tuple[str, str], Handler]) -> None:
        self.app = app
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            root: str = scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root) :]
            handler = self.routes.get((scope["method"], path))
            if handler is not None:
                response = await handler(Request(scope, receive))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
