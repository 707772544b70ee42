"""The gateway's upstream client: `Pool`, keep-alive connections to one upstream, one awaited
request each (the lean client's `Connection` under an awaitable owner).

`await pool.request(...)` returns a `Response`; what the gateway's upstream calls and health checks
use. Cancelling a request aborts its connection, so the upstream sees the hang-up at once (that is
how a deadline reaches a sandbox behind HTTP). An answer's body is kept up to the pool's
`max_body_bytes`; past it the request fails and the connection is closed.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from .connect import Connector
from .headers import INJECTED_DELAY
from .http1 import (
    ERR_CLOSED,
    ERR_PROTOCOL,
    ERR_TIMEOUT,
    ERROR_KINDS,
    Connection,
    Endpoint,
    encode_request,
)


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

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed:  # the upstream closed it, not the pool: it may be going away (a
            self.owner._connector.forget()  # stopped container), its address with it
        super().connection_lost(exc)

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
        # an IPv6 address in brackets (RFC 9110 7.2): `::1:8080` is malformed to a strict server
        named = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = f"{named}:{self.port}"
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self.max_idle = max_idle
        self.capture = {h.encode("latin-1"): h for h in kept_headers}
        self.body_limit = max_body_bytes
        self._idle: deque[_PoolConnection] = deque()
        self._connector = Connector(self.host, self.port)  # the name looked up once, kept

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
        looking_up = True
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                found = await self._connector.addresses(loop)
                looking_up = False
                conn = await self._connector.connect(
                    loop, lambda: _PoolConnection(self, loop), found
                )
        except TimeoutError as exc:
            if looking_up:  # no connect began: the name is what is slow (a stopped container's)
                raise ConnectFailed(
                    f"connect timed out: the lookup of {self.host!r} took over "
                    f"{self.connect_timeout_s:g} s"
                ) from exc
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
