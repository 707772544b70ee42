"""Calling an ASGI application in-process: its lifespan, and one HTTP request at a time.

Embedded mode mounts sandboxd and the emulators without a socket. The request runs in the
caller's task, so cancelling the caller (a deadline, a lost hedge) cancels the handler inside the
tool at its next await: the sandbox's own cleanup (kill and reap) runs from there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

log = logging.getLogger("toolenv.gateway")

Message = MutableMapping[str, Any]
ASGIApp = Callable[
    [
        MutableMapping[str, Any],
        Callable[[], Awaitable[Message]],
        Callable[[Message], Awaitable[None]],
    ],
    Awaitable[None],
]


class LifespanError(RuntimeError):
    """The application's start-up or shut-down failed."""


class Lifespan:
    """Drives an ASGI app's lifespan protocol the way a server would (start-up, then shut-down)."""

    def __init__(self, app: ASGIApp, name: str) -> None:
        self.app = app
        self.name = name
        self.state: dict[str, Any] = {}
        self._to_app: asyncio.Queue[Message] = asyncio.Queue()
        self._from_app: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._raised: Exception | None = None

    def _why(self, message: Message) -> str:
        """Why the start-up or shut-down failed: the exception the app raised after saying so
        (Starlette's `message` is the whole traceback, the server's files, 40 lines for `bwrap not
        found`), as its class and text; the message itself from an app that raised nothing."""
        if self._raised is not None:
            text = str(self._raised)
            return f"{type(self._raised).__name__}: {text}" if text else type(self._raised).__name__
        return message.get("message") or "(the app gave no reason)"

    async def _failed(self) -> None:
        """Starlette raises right after its `*.failed` message: let the task end to keep that."""
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=5.0)

    async def _run(self) -> None:
        scope = {
            "type": "lifespan",
            "asgi": {"version": "3.0", "spec_version": "2.0"},
            "state": self.state,
        }
        try:
            await self.app(scope, self._to_app.get, self._from_app.put)
        except Exception as exc:  # an app without lifespan support raises here: that is fine
            self._raised = exc
            await self._from_app.put({"type": "lifespan.error", "message": repr(exc)})

    async def start(self, timeout: float = 120.0) -> None:
        self._task = asyncio.create_task(self._run(), name=f"lifespan:{self.name}")
        await self._to_app.put({"type": "lifespan.startup"})
        message = await asyncio.wait_for(self._from_app.get(), timeout)
        if message["type"] == "lifespan.startup.failed":
            await self._failed()
            raise LifespanError(f"{self.name} failed to start: {self._why(message)}")
        if message["type"] == "lifespan.error":
            self._task = None  # no lifespan support: nothing to shut down

    async def stop(self, timeout: float = 30.0) -> None:
        if self._task is None or self._task.done():
            return
        await self._to_app.put({"type": "lifespan.shutdown"})
        try:
            message = await asyncio.wait_for(self._from_app.get(), timeout)
        except TimeoutError:
            self._task.cancel()
            raise LifespanError(f"{self.name} did not shut down within {timeout} s") from None
        if message["type"] == "lifespan.shutdown.failed":
            await self._failed()
            raise LifespanError(f"{self.name} failed to shut down: {self._why(message)}")


def raw_headers(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """`headers` as an HTTP server hands them to an app: names lower-cased, values the bytes they
    were read as (Latin-1, as servers decode them), so an in-process tool sees a caller's UTF-8
    `X-Trajectory-Id` as a proxied one does (UTF-8 of the Latin-1 reading sent it twice encoded)."""
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


async def call_asgi(
    app: ASGIApp,
    method: str,
    path: str,
    body: bytes,
    headers: list[tuple[bytes, bytes]],
    state: dict[str, Any],
    query_string: bytes = b"",
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """One HTTP request to `app` in this task; returns (status, headers, body)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query_string,
        "root_path": "",
        "headers": [(b"host", b"embedded"), *headers, (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 0),
        "server": ("embedded", 80),
        "state": dict(state),
    }
    sent_body = False
    disconnected = asyncio.Event()

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()  # like a client that keeps the connection open until answered
        return {"type": "http.disconnect"}

    status = 500
    out_headers: list[tuple[bytes, bytes]] = []
    chunks: list[bytes] = []
    complete = False

    async def send(message: Message) -> None:
        nonlocal status, out_headers, complete
        if message["type"] == "http.response.start":
            status = message["status"]
            out_headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                complete = True
                disconnected.set()

    try:
        await app(scope, receive, send)
    except Exception as exc:
        if not complete:
            raise ConnectionResetError(
                f"in-process app failed on {method} {path}: {type(exc).__name__}"
            ) from exc
        # Starlette re-raises after it has answered 500 (for the server's log): log it likewise
        log.error("in-process app error", exc_info=exc, extra={"path": path})
    finally:
        disconnected.set()
    if not complete:
        raise ConnectionResetError(
            f"in-process app ended {method} {path} without a complete response"
        )
    return status, out_headers, b"".join(chunks)
