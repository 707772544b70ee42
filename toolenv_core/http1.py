"""The one lean HTTP/1.1 client: raw keep-alive connections, an asyncio Protocol, httptools parsing.

Why not aiohttp or httpx: on this machine kind their per-request CPU (about 0.4 ms for aiohttp,
httpx tops out near 660 rps on one core) was several times the gateway's own, and a load
generator must spend its CPU on its own bookkeeping. A request is encoded once and written with
one `transport.write`; responses are parsed by httptools (the parser uvicorn uses) in callbacks,
with no task per request.

Two owners drive the same `Connection`:
- `Pool` (here): `await pool.request(...)` returns a `Response`; what the gateway's upstream calls
  and health checks use. Cancelling a request aborts its connection, so the upstream sees the
  hang-up at once (that is how a deadline reaches a sandbox behind HTTP).
- `stress.http.LoadClient`: a callback-driven pool that records per-request times into arrays.

Scope: plain `http://` only, one request at a time per connection (no pipelining), keep-alive
unless the server says `Connection: close`. Content-Length, chunked and read-until-close bodies
are all parsed (a `Pool` keeps a body up to its `max_body_bytes` and closes the connection past
it). A request written into a kept-alive connection that turns out to be closed,
before any answer byte, is the owner's to send again once on a fresh connection (the server
closed it while idle, so it never read the request), as browsers and httpx do; `Pool.request`
with `resend=False` does not (the same silence is what an upstream that read the request and died
before answering leaves: a request that must not run twice is then the owner's failure).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import httptools

from .connect import connect
from .headers import INJECTED_DELAY

# How a request failed (at the transport level, or as a gateway tool's error), as small
# integers (0 = no error) so that a load generator can store them per request in an int8 array.
ERROR_KINDS: tuple[str, ...] = (
    "",
    "timeout",  # no complete response within timeout_s of its scheduled send (a queue wait counts)
    "connect_error",  # the TCP connection could not be opened
    "connection_closed",  # the server closed or reset the connection mid-request
    "protocol_error",  # the response did not parse as HTTP/1.1
    "dropped",  # never sent: more than max_in_flight requests were outstanding at its send time
    "unfinished",  # still queued for a connection when the run ended
    "tool_error",  # a gateway tool call answered 200 with its tool's error (headers.TOOL_STATUS)
)
ERR_TIMEOUT, ERR_CONNECT, ERR_CLOSED, ERR_PROTOCOL, ERR_DROPPED, ERR_UNFINISHED, ERR_TOOL = range(
    1, 8
)


class TargetURLError(ValueError):
    """The URL is not a plain http:// URL this client can drive."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where requests go: host and port to connect to, the path, and the Host header."""

    host: str
    port: int
    path: str
    host_header: str

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        try:  # a bad port or IPv6 literal: urllib's words, with the URL they are about
            parts = urlsplit(url)
            if "@" in parts.netloc:  # never sent (no Authorization is made of it): refused, and
                # never echoed (a report's title and `config show` printed the password)
                shown = url.replace(parts.netloc, "***@" + parts.netloc.rsplit("@", 1)[1], 1)
                raise TargetURLError(
                    f"URL {shown!r} carries credentials (user:password@), which are not sent: "
                    "name it without them (and send an Authorization header where one is needed)"
                )
            port = 80 if parts.port is None else parts.port
        except TargetURLError:
            raise
        except ValueError as exc:
            raise TargetURLError(f"URL {url!r}: {exc}") from exc
        if parts.scheme != "http":
            raise TargetURLError(f"only plain http:// URLs are supported, got {url!r}")
        if not parts.hostname:
            raise TargetURLError(f"URL {url!r} has no host")
        if port == 0:  # `parts.port or 80` read it as 80: requests went to another server
            raise TargetURLError(f"URL {url!r} names port 0, which no server listens on")
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        return cls(parts.hostname, port, path, parts.netloc)


def encode_request(
    method: str, path: str, host_header: str, headers: Mapping[str, str], body: bytes
) -> bytes:
    """The complete request bytes (written as-is with one `transport.write`)."""
    head = f"{method} {path} HTTP/1.1\r\nhost: {host_header}\r\n"
    for name, value in headers.items():
        head += f"{name}: {value}\r\n"
    if body or method in ("POST", "PUT", "PATCH"):
        head += f"content-length: {len(body)}\r\n"
    return (head + "\r\n").encode("latin-1") + body


class Owner(Protocol):
    """What a `Connection` reports to: the pool that sent the request on it."""

    capture: Mapping[bytes, str]  # lower-cased header name -> key to store its value under
    body_limit: int  # bytes of each response body kept (`BodyConnection` cuts there; a `Pool`
    # fails the request past it, `ResponseTooLarge`)

    def _complete(self, conn: Connection, keep_alive: bool) -> None: ...

    def _fail(self, conn: Connection, error: int) -> None: ...

    def _retry(self, conn: Connection) -> None:
        """A reused connection closed before any answer byte: the request was never read."""

    def _lost(self, conn: Connection) -> None: ...


class Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time (`rid` >= 0 while it does)."""

    __slots__ = (
        "owner",
        "transport",
        "parser",
        "rid",
        "status",
        "captured",
        "body",
        "timer",
        "headers_done",
        "framed",
        "closed",
        "served",
        "got_bytes",
    )

    def __init__(self, owner: Owner) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.rid = -1
        self.status = 0
        self.captured: dict[str, str] | None = None
        self.body = bytearray()  # filled by BodyConnection only
        self.timer: asyncio.TimerHandle | None = None  # the owner's per-request timeout, if any
        self.headers_done = False
        self.framed = False  # Content-Length or chunked: the end is known without EOF
        self.closed = False
        self.served = 0  # responses completed on this connection
        self.got_bytes = False  # any byte of the current response arrived

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.owner._fail(self, ERR_PROTOCOL)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.rid >= 0:
            if self.headers_done and not self.framed:
                self.owner._complete(self, keep_alive=False)  # body delimited by EOF
            elif self.served and not self.got_bytes:
                self.owner._retry(self)
            else:
                self.owner._fail(self, ERR_CLOSED)
        self.owner._lost(self)

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self.headers_done = False
        self.framed = False

    def on_header(self, name: bytes, value: bytes) -> None:
        lname = name.lower()
        if lname == b"content-length" or lname == b"transfer-encoding":
            self.framed = True
        capture = self.owner.capture
        if capture and lname in capture:
            if self.captured is None:
                self.captured = {}
            self.captured[capture[lname]] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if not 100 <= self.status <= 599:
            # RFC 9110 15: not a status (httptools reads "099" as 99): an unparsable answer, as
            # any other broken one (the gateway passed 600 on and its own server failed: a 500)
            raise ValueError(f"status {self.status} is outside 100-599")
        self.headers_done = True
        if self.status == 204 or self.status == 304 or 100 <= self.status < 200:
            self.framed = True

    def on_message_complete(self) -> None:
        if 100 <= self.status < 200 and self.status != 101:
            # an interim answer (100 Continue, 103 Early Hints): the final one follows on this
            # connection (it was taken for the answer, and the real one was then dropped)
            self.status, self.captured, self.headers_done = 0, None, False
            return
        self.served += 1
        if self.rid >= 0:
            self.owner._complete(self, keep_alive=self.parser.should_keep_alive())

    # -- used by the owner
    def send(self, rid: int, data: bytes) -> None:
        self.rid = rid
        self.status = 0
        self.captured = None
        if self.body:
            self.body = bytearray()
        self.headers_done = False
        self.got_bytes = False
        self.transport.write(data)  # type: ignore[union-attr]

    def on_timeout(self) -> None:
        self.timer = None
        if self.rid >= 0:
            self.owner._fail(self, ERR_TIMEOUT)

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class BodyConnection(Connection):
    """A connection that also keeps the first `owner.body_limit` bytes of each response body
    (a separate class because httptools calls `on_body` per chunk once the method exists)."""

    __slots__ = ()

    def on_body(self, body: bytes) -> None:
        room = self.owner.body_limit - len(self.body)
        if room >= len(body):
            self.body += body
        elif room > 0:
            self.body += body[:room]


# ------------------------------------------------------------------ awaitable pool


class ConnectFailed(Exception):
    """The connection could not be opened (refused, unreachable, timed out)."""


class ConnectionBroken(Exception):
    """The connection failed after the request was sent (the upstream died or hung up)."""

    def __init__(self, message: str, answered_nothing: bool, unsent: bool = False) -> None:
        super().__init__(message)
        self.answered_nothing = answered_nothing
        self.unsent = unsent  # closed before the request was written: safe to send anywhere


class ResponseTooLarge(ConnectionBroken):
    """The answer's body grew past the pool's `max_body_bytes`: the connection was closed there,
    the rest of it never read (a misbehaving upstream cannot grow the caller's memory)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"answered more than {limit} bytes (the rest was not read)", False)
        self.limit = limit


class Response:
    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body


class _PoolConnection(Connection):
    __slots__ = ("waiter", "idle_since", "loop")
    owner: Pool  # the pool that opened it

    def __init__(self, owner: Pool, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(owner)
        self.waiter: asyncio.Future[Response] | None = None
        self.idle_since = 0.0
        # the loop it lives on, kept: `asyncio.get_running_loop()` costs a getpid() per call
        self.loop = loop

    def on_body(self, body: bytes) -> None:
        # The whole body is kept, up to the pool's limit (one compare per chunk, as
        # BodyConnection's cut makes): past it the request fails and the connection is closed.
        self.body += body
        if len(self.body) > self.owner.body_limit:
            self.owner._too_large(self)


_BROKEN = {
    ERR_CLOSED: "closed the connection mid-request",
    ERR_PROTOCOL: "unparsable answer",
    ERR_TIMEOUT: "timed out",
}
NO_LIMIT = 1 << 62
KEPT_HEADERS = ("content-type", INJECTED_DELAY.lower(), "retry-after")


class Pool:
    """Keep-alive connections to one upstream (`http://host:port[/path]`: the path goes before
    every request's), one awaited request each.

    Response headers named in `kept_headers` (lower-case) are returned; others are skipped. An
    answer whose body grows past `max_body_bytes` fails the request with `ResponseTooLarge`, its
    connection closed at once.
    """

    def __init__(
        self,
        base_url: str,
        connect_timeout_s: float,
        keepalive_s: float,
        max_idle: int = 256,
        kept_headers: tuple[str, ...] = KEPT_HEADERS,
        max_body_bytes: int = NO_LIMIT,
    ) -> None:
        endpoint = Endpoint.parse(base_url)
        # `http://host/tools/x` serves under /tools/x: its path goes before every request's
        self.prefix = endpoint.path.rstrip("/")
        self.host = endpoint.host
        self.port = endpoint.port
        self.host_header = f"{self.host}:{self.port}"
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self.max_idle = max_idle
        self.capture = {h.encode("latin-1"): h for h in kept_headers}
        self.body_limit = max_body_bytes
        self._idle: deque[_PoolConnection] = deque()

    async def request(
        self, method: str, path: str, headers: dict[str, str], body: bytes, resend: bool = True
    ) -> Response:
        """One request and its response. A reused connection that closes without a byte of answer
        is taken for a stale one and the request is sent again on a fresh connection, unless
        `resend` is False (a request that must not run twice: the upstream may have read it)."""
        payload = encode_request(method, self.prefix + path, self.host_header, headers, body)
        conn = self._take_idle()
        reused = conn is not None
        while True:  # at most twice: a reused connection found broken, then a fresh one
            try:
                if conn is None:
                    conn = await self._open()
                waiter = self._start(conn, payload)  # awaited here: no frame of its own per call
                try:
                    return await waiter
                except asyncio.CancelledError:
                    conn.abort()  # the upstream sees the hang-up now and stops working on it
                    raise
            except ConnectionBroken as exc:
                if not (reused and exc.answered_nothing and (resend or exc.unsent)):
                    raise
                # Maybe a stale idle connection, maybe an upstream that died reading the
                # request: one fresh attempt tells them apart; if it cannot connect, the
                # upstream is gone.
                reused = False
                try:
                    conn = await self._open()
                except ConnectFailed:
                    raise exc from None

    def close(self) -> None:
        while self._idle:
            self._idle.pop().abort()

    # -- internals
    async def _open(self) -> _PoolConnection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                conn = await connect(
                    loop, lambda: _PoolConnection(self, loop), self.host, self.port
                )
        except TimeoutError as exc:
            raise ConnectFailed("connect timed out") from exc
        except OSError as exc:
            raise ConnectFailed(f"cannot connect ({exc.strerror or exc})") from exc
        return conn

    def _take_idle(self) -> _PoolConnection | None:
        now = time.monotonic()
        while self._idle:
            conn = self._idle.pop()  # most recently used: warmest, least likely closed
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.abort()
        return None

    @staticmethod
    def _start(conn: _PoolConnection, payload: bytes) -> asyncio.Future[Response]:
        """The request written on `conn`: the future of its response."""
        if conn.closed or conn.transport is None:
            raise ConnectionBroken("the connection was already closed", True, unsent=True)
        waiter: asyncio.Future[Response] = conn.loop.create_future()
        conn.waiter = waiter
        conn.send(0, payload)
        return waiter

    @staticmethod
    def _settle(conn: Connection) -> asyncio.Future[Response] | None:
        assert isinstance(conn, _PoolConnection)
        waiter, conn.waiter, conn.rid = conn.waiter, None, -1
        return waiter if waiter is not None and not waiter.done() else None

    # -- Owner callbacks
    def _complete(self, conn: Connection, keep_alive: bool) -> None:
        assert isinstance(conn, _PoolConnection)
        waiter = self._settle(conn)
        if waiter is not None:
            waiter.set_result(Response(conn.status, conn.captured or {}, bytes(conn.body)))
        if keep_alive and not conn.closed and len(self._idle) < self.max_idle:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.abort()

    def _fail(self, conn: Connection, error: int) -> None:
        waiter = self._settle(conn)
        conn.abort()
        if waiter is not None:
            reason = _BROKEN.get(error, ERROR_KINDS[error])
            waiter.set_exception(ConnectionBroken(reason, not conn.got_bytes))

    def _too_large(self, conn: _PoolConnection) -> None:
        waiter = self._settle(conn)
        conn.abort()  # read no further: the rest of the answer is never taken in
        conn.body = bytearray()
        if waiter is not None:
            waiter.set_exception(ResponseTooLarge(self.body_limit))

    def _retry(self, conn: Connection) -> None:
        waiter = self._settle(conn)
        if waiter is not None:
            waiter.set_exception(ConnectionBroken("closed the connection mid-request", True))

    def _lost(self, conn: Connection) -> None:
        return None  # a closed idle connection is skipped by `_take_idle`
