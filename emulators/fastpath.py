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


def fast_routes(router: APIRouter) -> dict[tuple[str, str], Handler]:
    """The direct-lane handlers a router declared (attribute set by the router's builder)."""
    return dict(getattr(router, "fast_routes", {}))


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


def register(
    router: APIRouter, method: str, path: str, handler: Handler, **route_kwargs: Any
) -> None:
    """Add `handler` as a documented FastAPI route and as a direct-lane route."""
    router.add_api_route(path, handler, methods=[method], **route_kwargs)
    lanes = getattr(router, "fast_routes", None)
    if lanes is None:
        lanes = {}
        router.fast_routes = lanes  # type: ignore[attr-defined]
    lanes[(method, path)] = handler
