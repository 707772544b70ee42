"""A lean HTTP/1.1 load client: raw keep-alive connections, asyncio Protocol + httptools parser.

Why not httpx or aiohttp: a load generator spends its CPU on its own bookkeeping, not on the
server; httpx tops out near 660 rps on one core here. This client pre-encodes every request,
writes it with one `transport.write`, parses responses with httptools (C, llhttp) in callbacks,
and never creates a task per request, so one core drives several thousand requests per second.

Scope: plain `http://` only, one request at a time per connection (no pipelining), keep-alive
unless the server says `Connection: close`. Content-Length, chunked and read-until-close bodies
are all parsed (bodies are counted, never kept, unless `capture_body_bytes` asks for a prefix).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httptools

# Error kinds, stored as small integers in the per-request arrays (0 = no error).
ERROR_KINDS: tuple[str, ...] = (
    "",
    "timeout",  # no complete response within timeout_s of sending (or of scheduling, if queued)
    "connect_error",  # the TCP connection could not be opened
    "connection_closed",  # the server closed or reset the connection mid-request
    "protocol_error",  # the response did not parse as HTTP/1.1
    "dropped",  # never sent: more than max_in_flight requests were outstanding at its send time
    "unfinished",  # still queued for a connection when the run ended
)
ERR_TIMEOUT, ERR_CONNECT, ERR_CLOSED, ERR_PROTOCOL, ERR_DROPPED, ERR_UNFINISHED = range(1, 7)
# Key under which a kept response-body prefix is stored among a request's captured headers
# (a header name cannot contain ":", so it never collides with one).
BODY_KEY = ":body"
# Connects under way at once: more would only flood the loop (and the server's accept queue);
# requests that find no free connection wait in order, and that wait counts in their latency.
MAX_CONCURRENT_CONNECTS = 256


class TargetURLError(ValueError):
    """The URL is not a plain http:// URL this client can drive."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int
    path: str
    host_header: str

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme != "http":
            raise TargetURLError(f"only http:// URLs are supported, got {url!r}")
        if not parts.hostname:
            raise TargetURLError(f"URL {url!r} has no host")
        port = parts.port or 80
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        host_header = parts.netloc.rsplit("@", 1)[-1]
        return cls(parts.hostname, port, path, host_header)


def encode_body(body: bytes | str | Mapping[str, Any] | Sequence[Any] | None) -> bytes:
    if body is None:
        return b""
    if isinstance(body, bytes):
        return body
    if isinstance(body, str):
        return body.encode()
    return json.dumps(body, separators=(",", ":")).encode()


def encode_request(
    endpoint: Endpoint, method: str, body: bytes, headers: Mapping[str, str]
) -> bytes:
    """The complete request bytes, built once and written as-is for every send."""
    lines = [f"{method.upper()} {endpoint.path} HTTP/1.1", f"Host: {endpoint.host_header}"]
    lower = {k.lower() for k in headers}
    if body and "content-type" not in lower:
        lines.append("Content-Type: application/json")
    if body or method.upper() in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    if "user-agent" not in lower:
        lines.append("User-Agent: toolenv-stress")
    lines.extend(f"{k}: {v}" for k, v in headers.items())
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    __slots__ = (
        "pool",
        "transport",
        "parser",
        "rid",
        "status",
        "captured",
        "timer",
        "headers_done",
        "framed",
        "closed",
        "served",
        "got_bytes",
    )

    def __init__(self, pool: LoadClient) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.rid = -1
        self.status = 0
        self.captured: dict[str, str] | None = None
        self.timer: asyncio.TimerHandle | None = None
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
            self.pool._fail(self, ERR_PROTOCOL)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.rid >= 0:
            if self.headers_done and not self.framed:
                self.pool._complete(self, keep_alive=False)  # body delimited by EOF
            elif self.served and not self.got_bytes:
                # the server closed a kept-alive connection as we reused it: not the request's
                # fault; send it again once on a fresh connection (as browsers and httpx do)
                self.pool._retry(self)
            else:
                self.pool._fail(self, ERR_CLOSED)
        self.pool._lost(self)

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        self.headers_done = False
        self.framed = False

    def on_header(self, name: bytes, value: bytes) -> None:
        lname = name.lower()
        if lname in (b"content-length", b"transfer-encoding"):
            self.framed = True
        capture = self.pool.capture
        if capture and lname in capture:
            if self.captured is None:
                self.captured = {}
            self.captured[capture[lname]] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True
        if self.status == 204 or self.status == 304 or 100 <= self.status < 200:
            self.framed = True

    def on_message_complete(self) -> None:
        self.served += 1
        if self.rid >= 0:
            self.pool._complete(self, keep_alive=self.parser.should_keep_alive())

    # -- used by the pool
    def send(self, rid: int, data: bytes) -> None:
        self.rid = rid
        self.status = 0
        self.captured = None
        self.headers_done = False
        self.got_bytes = False
        self.transport.write(data)  # type: ignore[union-attr]

    def on_timeout(self) -> None:
        self.timer = None
        if self.rid >= 0:
            self.pool._fail(self, ERR_TIMEOUT)


class _BodyConnection(_Connection):
    """A connection that also keeps the first `pool.capture_body_bytes` of each response body
    (only used when asked for: httptools calls `on_body` per chunk once the method exists)."""

    __slots__ = ("body",)

    def __init__(self, pool: LoadClient) -> None:
        self.body = bytearray()
        super().__init__(pool)

    def on_body(self, body: bytes) -> None:
        room = self.pool.capture_body_bytes - len(self.body)
        if room > 0:
            self.body += body[:room]

    def on_message_complete(self) -> None:
        if self.rid >= 0:
            if self.captured is None:
                self.captured = {}
            self.captured[BODY_KEY] = self.body.decode("utf-8", errors="replace")
        super().on_message_complete()

    def send(self, rid: int, data: bytes) -> None:
        self.body = bytearray()
        super().send(rid, data)


class Recorder:
    """Per-request arrays, preallocated for the request cap (times are time.monotonic())."""

    def __init__(self, capacity: int) -> None:
        import numpy as np

        self.scheduled = np.full(capacity, np.nan)
        self.sent = np.full(capacity, np.nan)
        self.dispatched = np.full(capacity, np.nan)  # handed to the client by the scheduler
        self.done = np.full(capacity, np.nan)
        self.status = np.zeros(capacity, dtype=np.int16)
        self.error = np.zeros(capacity, dtype=np.int8)
        self.captured: dict[int, dict[str, str]] = {}


class LoadClient:
    """A bounded pool of keep-alive connections to one endpoint, driven by callbacks.

    `submit(rid)` sends request `rid` on an idle connection, opens a new one (up to
    `max_connections`), or queues it; the request's latency clock started at its scheduled time,
    so queueing here is measured, not hidden. `on_done(rid)` is called when it ends either way.
    """

    def __init__(
        self,
        endpoint: Endpoint,
        requests: Sequence[bytes],
        recorder: Recorder,
        *,
        max_connections: int,
        timeout_s: float,
        capture_headers: Sequence[str] = (),
        on_done: Callable[[int], None] | None = None,
        capture_body_bytes: int = 0,
    ) -> None:
        self.endpoint = endpoint
        self.requests = requests
        self.rec = recorder
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.capture = {h.lower().encode("latin-1"): h for h in capture_headers}
        self.on_done = on_done
        self.capture_body_bytes = capture_body_bytes
        self._protocol = _BodyConnection if capture_body_bytes > 0 else _Connection
        self.loop = asyncio.get_running_loop()
        self.idle: list[_Connection] = []
        self.waiting: deque[int] = deque()
        self.connections: set[_Connection] = set()
        self.opening = 0
        self.in_flight = 0  # submitted and not yet done (queued + on the wire)
        self.connect_errors: list[str] = []
        self.retried: set[int] = set()
        self._idle_event: asyncio.Event | None = None
        self._closed = False
        self._connect_tasks: set[asyncio.Task[None]] = set()

    # -- public
    def submit(self, rid: int) -> None:
        self.in_flight += 1
        if self.idle:
            self._send(self.idle.pop(), rid)
            return
        self.waiting.append(rid)
        if self.opening < len(self.waiting) and self._may_open():
            self._open()

    async def preconnect(self, count: int) -> None:
        """Open up to `count` connections before the clock starts (connect cost is not load)."""
        count = min(count, self.max_connections) - len(self.connections) - self.opening
        if count <= 0:
            return
        self.opening += count
        await asyncio.gather(*(self._connect() for _ in range(count)))

    async def drain(self, timeout_s: float) -> None:
        """Wait until nothing is in flight (or `timeout_s`), then end what is still queued."""
        end = time.monotonic() + timeout_s
        while self.in_flight > 0 and time.monotonic() < end:
            self._idle_event = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle_event.wait(), max(0.0, end - time.monotonic()))
            except TimeoutError:
                break
        now = time.monotonic()
        while self.waiting:
            self._finish(self.waiting.popleft(), now, 0, ERR_UNFINISHED)

    async def aclose(self) -> None:
        """`close`, then wait for the cancelled connects (no task outlives the run)."""
        self.close()
        if self._connect_tasks:
            await asyncio.gather(*self._connect_tasks, return_exceptions=True)

    def close(self) -> None:
        self._closed = True
        for task in list(self._connect_tasks):
            task.cancel()
        for conn in list(self.connections):
            if conn.timer is not None:
                conn.timer.cancel()
            if conn.rid >= 0:
                rid, conn.rid = conn.rid, -1
                self._finish(rid, time.monotonic(), 0, ERR_UNFINISHED)
            if conn.transport is not None:
                conn.transport.abort()
        self.connections.clear()
        self.idle.clear()

    # -- internals
    def _send(self, conn: _Connection, rid: int) -> None:
        self.rec.sent[rid] = time.monotonic()
        conn.timer = self.loop.call_at(self.loop.time() + self.timeout_s, conn.on_timeout)
        conn.send(rid, self.requests[rid % len(self.requests)])

    def _finish(self, rid: int, now: float, status: int, error: int) -> None:
        rec = self.rec
        rec.done[rid] = now
        rec.status[rid] = status
        rec.error[rid] = error
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle_event is not None:
            self._idle_event.set()
        if self.on_done is not None:
            self.on_done(rid)

    def _complete(self, conn: _Connection, keep_alive: bool) -> None:
        now = time.monotonic()
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        rid, conn.rid = conn.rid, -1
        status = conn.status
        if conn.captured:
            self.rec.captured[rid] = conn.captured
        self._finish(rid, now, status, 0)
        if keep_alive and not conn.closed:
            self._release(conn)
        else:
            self._drop(conn)

    def _fail(self, conn: _Connection, error: int) -> None:
        now = time.monotonic()
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        rid, conn.rid = conn.rid, -1
        self._drop(conn)
        if rid >= 0:
            self._finish(rid, now, conn.status if error != ERR_TIMEOUT else 0, error)

    def _retry(self, conn: _Connection) -> None:
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        rid, conn.rid = conn.rid, -1
        if rid in self.retried:
            conn.rid = rid
            self._fail(conn, ERR_CLOSED)
            return
        self.retried.add(rid)
        self.waiting.appendleft(rid)
        self._drop(conn)  # opens a fresh connection for it when the limit allows
        if self.opening == 0 and self.idle:
            self._release(self.idle.pop())

    def _release(self, conn: _Connection) -> None:
        """A free connection takes the next queued request, or goes idle."""
        waiting = self.waiting
        scheduled = self.rec.scheduled
        while waiting:
            rid = waiting.popleft()
            now = time.monotonic()
            if now - scheduled[rid] > self.timeout_s:  # waited out its whole timeout in the queue
                self._finish(rid, now, 0, ERR_TIMEOUT)
                continue
            self._send(conn, rid)
            return
        self.idle.append(conn)

    def _drop(self, conn: _Connection) -> None:
        if conn in self.connections:
            self.connections.discard(conn)
            if conn.transport is not None and not conn.closed:
                conn.transport.abort()
            if self.waiting and self._may_open():
                self._open()

    def _lost(self, conn: _Connection) -> None:
        if conn in self.connections:
            self.connections.discard(conn)
            if conn in self.idle:
                self.idle.remove(conn)
            if self.waiting and self._may_open():
                self._open()

    def _may_open(self) -> bool:
        return (
            self.opening < MAX_CONCURRENT_CONNECTS
            and len(self.connections) + self.opening < self.max_connections
        )

    def _open(self) -> None:
        self.opening += 1
        task = self.loop.create_task(self._connect())
        self._connect_tasks.add(task)
        task.add_done_callback(self._connect_tasks.discard)

    async def _connect(self) -> None:
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: self._protocol(self), self.endpoint.host, self.endpoint.port
                ),
                self.timeout_s,
            )
        except (OSError, TimeoutError) as exc:
            self.opening -= 1
            if len(self.connect_errors) < 5:
                self.connect_errors.append(f"{type(exc).__name__}: {exc}")
            if self.waiting:  # fail one queued request per failed connect, then try again
                self._finish(self.waiting.popleft(), time.monotonic(), 0, ERR_CONNECT)
                if self.waiting and self._may_open():
                    self._open()
            return
        self.opening -= 1
        if self._closed:  # the run ended while this connect was under way
            conn.transport.abort()  # type: ignore[union-attr]
            return
        self.connections.add(conn)
        self._release(conn)
        while self.opening < len(self.waiting) and self._may_open():  # connects were capped
            self._open()
