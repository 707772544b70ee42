"""A 405's `Allow` naming every method its path takes (RFC 9110), for every service's app.

Starlette answers a wrong method with the methods of the first route whose path matched: an
emulator's `/healthz` (a GET route and a HEAD route) said `Allow: HEAD`, and its profile path
(GET and PUT) `Allow: GET`, so a client that believed it could not tell the other method was
there. Each route is asked through Starlette's own matching, method by method: FastAPI 0.165
keeps an included router's routes behind one route of its own.
"""

from __future__ import annotations

from fastapi.exception_handlers import http_exception_handler
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match

HTTP_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")  # Allow's order


def allowed_methods(request: Request) -> str:
    """Every method the request's path takes, as an `Allow` value ("" for no route)."""
    routes = request.app.router.routes
    return ", ".join(
        method
        for method in HTTP_METHODS
        if any(r.matches({**request.scope, "method": method})[0] is Match.FULL for r in routes)
    )


async def http_error(request: Request, exc: Exception) -> Response:
    """FastAPI's answer to an HTTP error, with a 405's `Allow` made whole: the handler sandboxd
    and the emulators install for `HTTPException` (the gateway's own adds its request id)."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        headers = {**(exc.headers or {}), "Allow": allowed_methods(request)}
        exc = HTTPException(405, exc.detail, headers)
    return await http_exception_handler(request, exc)
