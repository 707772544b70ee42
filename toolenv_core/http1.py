"""A lean HTTP/1.1 client for upstream calls: keep-alive pools, httptools parsing, prompt cancel.

Why not aiohttp or httpx: on this machine kind their per-request CPU (about 0.4 ms for aiohttp)
was several times the gateway's own, and the gateway's overhead budget is 1 ms at p50. This
client does one `write` per request and parses with httptools (the parser uvicorn uses).

Cancelling a request aborts its connection, so the upstream sees the hang-up at once (that is
how a deadline reaches a sandbox behind HTTP). A request written into a kept-alive connection
that turns out to be closed, before any answer byte, is sent again once on a fresh connection
(the upstream closed it while idle, so it never read the request).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from urllib.parse import urlsplit

import httptools

KEPT_HEADERS = frozenset({b"content-type", b"x-toolenv-injected-delay-ms", b"retry-after"})


class ConnectFailed(Exception):
    """The connection could not be opened (refused, unreachable, timed out)."""


class ConnectionBroken(Exception):
    """The connection failed after the request was sent (the upstream died or hung up)."""

    def __init__(self, message: str, answered_nothing: bool) -> None:
        super().__init__(message)
        self.answered_nothing = answered_nothing


class Response:
    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body


class _Connection(asyncio.Protocol):
    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[Response] | None = None
        self.closed = False
        self.idle_since = 0.0
        self.got_bytes = False
        self._reset()

    def _reset(self) -> None:
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.keep_alive = True
        self.got_bytes = False

    # ---- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionBroken(f"unparsable answer: {exc}", False))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            reason = (
                "closed the connection mid-request" if exc is None else f"connection lost ({exc})"
            )
            self._fail(ConnectionBroken(reason, not self.got_bytes))

    # ---- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in KEPT_HEADERS:
            self.headers[name.decode()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        waiter = self.waiter
        response = Response(self.parser.get_status_code(), self.headers, b"".join(self.chunks))
        keep = self.keep_alive
        self.waiter = None
        self._reset()
        if waiter is not None and not waiter.done():
            waiter.set_result(response)
        if keep and not self.closed:
            self.pool._release(self)
        else:
            self.abort()

    # ----
    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        self.waiter = None

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class Pool:
    """Keep-alive connections to one upstream (`http://host:port`)."""

    def __init__(
        self, base_url: str, connect_timeout_s: float, keepalive_s: float, max_idle: int = 256
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError(f"{base_url}: the lean client speaks plain http:// only")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.host_header = f"{self.host}:{self.port}".encode()
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self.max_idle = max_idle
        self._idle: deque[_Connection] = deque()

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self), self.host, self.port
                )
        except TimeoutError as exc:
            raise ConnectFailed("connect timed out") from exc
        except OSError as exc:
            raise ConnectFailed(f"cannot connect ({exc.strerror or exc})") from exc
        return conn  # type: ignore[return-value]

    def _take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # most recently used: warmest, least likely closed
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.abort()
        return None

    def _release(self, conn: _Connection) -> None:
        if len(self._idle) >= self.max_idle:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    async def request(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> Response:
        head = [f"{method} {path} HTTP/1.1\r\n".encode(), b"host: ", self.host_header, b"\r\n"]
        for name, value in headers.items():
            head.append(f"{name}: {value}\r\n".encode("latin-1"))
        head.append(f"content-length: {len(body)}\r\n\r\n".encode())
        payload = b"".join(head) + body
        conn = self._take_idle()
        reused = conn is not None
        try:
            return await self._send(conn or await self._open(), payload)
        except ConnectionBroken as exc:
            if not (reused and exc.answered_nothing):
                raise
            # Maybe a stale idle connection, maybe an upstream that died reading the request:
            # one fresh attempt tells them apart; if it cannot connect, the upstream is gone.
            try:
                fresh = await self._open()
            except ConnectFailed:
                raise exc from None
            return await self._send(fresh, payload)

    async def _send(self, conn: _Connection, payload: bytes) -> Response:
        if conn.closed or conn.transport is None:
            raise ConnectionBroken("the connection was already closed", True)
        waiter: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        conn.waiter = waiter
        conn.transport.write(payload)
        try:
            return await waiter
        except asyncio.CancelledError:
            conn.abort()  # the upstream sees the hang-up now and stops working on it
            raise

    def close(self) -> None:
        while self._idle:
            self._idle.pop().abort()
