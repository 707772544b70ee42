"""The load generator's connection pool: requests by index, times into preallocated arrays.

The connections, request encoding and parsing are the shared lean client
(`toolenv_core.http1`); this module adds what a load generator needs on top: requests
pre-encoded once and sent by index, a bounded pool that queues in order (and counts the wait in
the latency), per-request timeouts, and no task per request, so one core drives several thousand
requests per second. Bodies are counted, never kept, unless `capture_body_bytes` asks for a
prefix.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httptools
import numpy as np

from toolenv_core.headers import TOOL_STATUS
from toolenv_core.http1 import (
    ERR_CLOSED,
    ERR_CONNECT,
    ERR_TIMEOUT,
    ERR_TOOL,
    ERR_UNFINISHED,
    BodyConnection,
    Connection,
    Endpoint,
)
from toolenv_core.http1 import encode_request as encode_http_request

# Key under which a kept response-body prefix is stored among a request's captured headers
# (a header name cannot contain ":", so it never collides with one).
BODY_KEY = ":body"
# The gateway's generic call says its answer's status in this header (`ok`, `error`): read on every
# response, kept among the captured values only when asked for.
_TOOL_STATUS = TOOL_STATUS.lower().encode("latin-1")
# Connects under way at once: more would only flood the loop (and the server's accept queue);
# requests that find no free connection wait in order, and that wait counts in their latency.
MAX_CONCURRENT_CONNECTS = 256


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
    """A load request: JSON content type and a user agent unless the caller set them; the caller's
    Host header instead of the URL's (it was sent beside it: two Host headers)."""
    host = next((v for k, v in headers.items() if k.lower() == "host"), endpoint.host_header)
    headers = {k: v for k, v in headers.items() if k.lower() != "host"}
    lower = {k.lower() for k in headers}
    defaults = {}
    if body and "content-type" not in lower:
        defaults["Content-Type"] = "application/json"
    if "user-agent" not in lower:
        defaults["User-Agent"] = "toolenv-stress"
    return encode_http_request(method.upper(), endpoint.path, host, {**defaults, **headers}, body)


class HeadConnection(Connection):
    """A connection for HEAD requests: an answer ends with its head, whatever Content-Length it
    declares (httptools cannot be told the request's method: it waited for that many bytes, and
    every HEAD request was a timeout, "the target never answered")."""

    __slots__ = ()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # a parse error fails the request (its rid is then -1)
        if self.headers_done and self.rid >= 0:  # a head with a length: no more is coming
            keep_alive = self.parser.should_keep_alive()
            self.parser = httptools.HttpResponseParser(self)  # for the next answer's head
            self.served += 1
            self.owner._complete(self, keep_alive=keep_alive)


class Recorder:
    """Per-request arrays, preallocated for the request cap (times are time.monotonic())."""

    def __init__(self, capacity: int) -> None:
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
        head_only: bool = False,
    ) -> None:
        self.endpoint = endpoint
        self.requests = requests
        self.rec = recorder
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.capture = {_TOOL_STATUS: TOOL_STATUS}
        self.capture.update((h.lower().encode("latin-1"), h) for h in capture_headers)
        self.tool_status = self.capture[_TOOL_STATUS]  # its name among the captured values
        self.keep_tool_status = any(h.lower() == TOOL_STATUS.lower() for h in capture_headers)
        self.on_done = on_done
        self.body_limit = capture_body_bytes
        self._protocol: type[Connection] = (
            HeadConnection
            if head_only
            else BodyConnection
            if capture_body_bytes > 0
            else Connection
        )
        self.loop = asyncio.get_running_loop()
        self.idle: list[Connection] = []
        self.waiting: deque[int] = deque()
        self.connections: set[Connection] = set()
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
    def _send(self, conn: Connection, rid: int) -> None:
        now = time.monotonic()
        self.rec.sent[rid] = now
        # Its clock started at its schedule, the wait for a connection included: a request that
        # waited got a whole timeout more once sent (ok at 1.75 s under a 1.5 s --timeout).
        left = self.rec.scheduled[rid] + self.timeout_s - now
        conn.timer = self.loop.call_at(self.loop.time() + left, conn.on_timeout)
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

    def _complete(self, conn: Connection, keep_alive: bool) -> None:
        now = time.monotonic()
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        rid, conn.rid = conn.rid, -1
        status, error, captured = conn.status, 0, conn.captured
        if captured is not None and self.tool_status in captured:
            if captured[self.tool_status] != "ok":  # a gateway tool's error answer, a 200
                error = ERR_TOOL
            if not self.keep_tool_status:
                del captured[self.tool_status]
        if self.body_limit:
            if captured is None:
                captured = {}
            captured[BODY_KEY] = conn.body.decode("utf-8", errors="replace")
        if captured:
            self.rec.captured[rid] = captured
        self._finish(rid, now, status, error)
        if keep_alive and not conn.closed:
            # on the loop's next turn: bytes past this answer's end in the same read broke the
            # parser with the next request already on it, which was failed for them in no time
            self.loop.call_soon(self._reuse, conn)
        else:
            self._drop(conn)

    def _reuse(self, conn: Connection) -> None:
        if conn in self.connections and not conn.closed:
            self._release(conn)

    def _fail(self, conn: Connection, error: int) -> None:
        now = time.monotonic()
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        rid, conn.rid = conn.rid, -1
        self._drop(conn)
        if rid >= 0:
            self._finish(rid, now, conn.status if error != ERR_TIMEOUT else 0, error)

    def _retry(self, conn: Connection) -> None:
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

    def _release(self, conn: Connection) -> None:
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

    def _drop(self, conn: Connection) -> None:
        if conn in self.connections:
            self.connections.discard(conn)
            if conn in self.idle:  # bytes past an answer's end broke an idle one: never reused
                self.idle.remove(conn)  # (its next request was written to a closed transport)
            if conn.transport is not None and not conn.closed:
                conn.transport.abort()
            if self.waiting and self._may_open():
                self._open()

    def _lost(self, conn: Connection) -> None:
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
            # a connect that timed out has no words of its own ("TimeoutError: " was the line)
            said = str(exc) or f"no connection within the {self.timeout_s:g} s timeout"
            message = f"{type(exc).__name__}: {said}"
            if len(self.connect_errors) < 5 and message not in self.connect_errors:
                self.connect_errors.append(message)  # the first five kinds, each once
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
