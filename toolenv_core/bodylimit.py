"""A request body's two bounds, shared by the services' front doors: at most `max_body_bytes`
(else 413) and whole within `body_timeout_s` (else 408, connection closed).

Why: a declared body that never arrives would hold a connection (and its handler) with no
answer, and a huge body would be read whole into memory. The gateway's door (`gateway.guard`)
runs its app through `run_bounded` too; `BodyLimit` is the pure ASGI middleware for a service
served alone (the emulators, sandboxd). `BodyTimeout` is an HTTPException so that a framework
route that reads its own body answers it as it is, not as a body it failed to parse.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from typing import Any, NamedTuple

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

CLOSE = ((b"connection", b"close"),)  # a 408 leaves the rest of the body unread: close


class BodyTooLarge(Exception):
    """Past `max_body_bytes`. Not an HTTPException: whatever route read the body, it reaches the
    front door, which answers it in its own form."""


class BodyTimeout(HTTPException):
    """The request body did not arrive in time (e.g. shorter than its Content-Length)."""

    def __init__(self, detail: str) -> None:
        super().__init__(408, detail, headers={"connection": "close"})


def too_large_message(max_body_bytes: int) -> str:
    return f"request body exceeds the limit of {max_body_bytes} bytes"


def body_timeout_message(
    body_timeout_s: float, seen: int, headers: Iterable[tuple[bytes, bytes]]
) -> str:
    length = next((v.decode("latin-1") for k, v in headers if k == b"content-length"), None)
    return (
        f"the request body did not arrive within {body_timeout_s:g} s "
        f"({seen} bytes of {length or 'a chunked body'}); the connection is closed"
    )


BAD_LENGTH = "Content-Length is not a number"


def content_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    """The declared Content-Length (None: none, e.g. chunked); ValueError if not a number."""
    length = next((v for k, v in headers if k == b"content-length"), None)
    return None if length is None else int(length)


class Refusal(NamedTuple):
    """What a front door answers when a bound stopped the app before its response began."""

    status: int
    detail: str
    headers: tuple[tuple[bytes, bytes], ...] = ()


async def run_bounded(
    app: ASGIApp,
    scope: Scope,
    receive: Receive,
    send: Send,
    max_body_bytes: int,
    body_timeout_s: float,
    declared: int | None = None,
) -> Refusal | None:
    """Run `app` with its request body bounded: whole within `body_timeout_s` of now, and at
    most `max_body_bytes` counted as it arrives. A `declared` Content-Length (the caller's to
    parse) over the limit is refused at the app's first read, before any of the body is read:
    a route that reads no body (a GET, an unknown path's 404, a wrong method's 405) answers as
    it would without the limit. Returns the 413 or 408 to answer when a bound stopped the app
    before it began its response (None: the app answered)."""
    headers = scope["headers"]
    loop = asyncio.get_running_loop()
    cutoff = loop.time() + body_timeout_s
    seen = 0
    body_done = False
    started = False
    too_large = declared is not None and declared > max_body_bytes

    async def guarded_receive() -> Message:
        nonlocal seen, body_done
        if body_done:  # after the body: the server's disconnect notice, whenever it comes
            return await receive()
        if too_large:
            raise BodyTooLarge
        try:
            async with asyncio.timeout(cutoff - loop.time()):
                message = await receive()
        except TimeoutError:
            raise BodyTimeout(body_timeout_message(body_timeout_s, seen, headers)) from None
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > max_body_bytes:
                raise BodyTooLarge
            body_done = not message.get("more_body", False)
        return message

    async def tracking_send(message: Message) -> None:
        nonlocal started
        started = started or message["type"] == "http.response.start"
        await send(message)

    try:
        await app(scope, guarded_receive, tracking_send)
    except BodyTooLarge:
        return None if started else Refusal(413, too_large_message(max_body_bytes))
    except BodyTimeout as exc:  # raised past the app's own error handling (a raw ASGI route)
        return None if started else Refusal(408, exc.detail, CLOSE)
    except ClientDisconnect:  # the caller left before its body was whole: nobody to answer (it
        return None  # reached uvicorn as "Exception in ASGI application" and a traceback)
    return None


class BodyLimit:
    """Both bounds as ASGI middleware: a Content-Length over the limit is refused when the app
    first reads the body, before any of it is read; a body without one (chunked) is counted as
    it arrives."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            declared = content_length(scope["headers"])
        except ValueError:
            await _reply(send, Refusal(400, BAD_LENGTH))
            return
        refusal = await run_bounded(
            self.app, scope, receive, send, self.max_body_bytes, self.body_timeout_s, declared
        )
        if refusal is not None:
            await _reply(send, refusal)


async def _reply(send: Send, refusal: Refusal) -> None:
    body = json.dumps({"detail": refusal.detail}).encode()
    headers: list[Any] = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *refusal.headers,
    ]
    await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
