"""A lean open-loop HTTP/1.1 load client for the fidelity bench (asyncio protocols, keep-alive).

aiohttp and httpx spend most of a millisecond of CPU per request; at 1,000-2,000 requests/s on
two shared cores that is the bottleneck, not the service. This client writes a prepared request
on an idle keep-alive connection and parses only what the bench needs (status, Content-Length,
two `X-Toolenv-*` headers), taking the completion time the moment the last byte arrives.
Not a general client: no TLS, no chunked bodies, no redirects.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque

_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)
_INJECTED = re.compile(rb"\r\nx-toolenv-injected-delay-ms:\s*([-0-9.]+)", re.IGNORECASE)
_TIMER = re.compile(rb"\r\nx-toolenv-timer-error-ms:\s*([-0-9.]+)", re.IGNORECASE)


class Reply:
    __slots__ = ("done", "injected_ms", "sent", "status", "timer_ms")

    def __init__(
        self, status: int, sent: float, done: float, injected_ms: float, timer_ms: float
    ) -> None:
        self.status = status
        self.sent = sent
        self.done = done
        self.injected_ms = injected_ms
        self.timer_ms = timer_ms


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[Reply] | None = None
        self.sent = 0.0
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection closed"))

    def send(self, request: bytes) -> asyncio.Future[Reply]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.sent = time.monotonic()
        self.transport.write(request)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[: end + 2])
        m = _CONTENT_LENGTH.search(head)
        length = int(m.group(1)) if m else 0
        if len(self.buf) < end + 4 + length:
            return
        done = time.monotonic()
        del self.buf[: end + 4 + length]
        injected = _INJECTED.search(head)
        timer = _TIMER.search(head)
        reply = Reply(
            int(head[9:12]),
            self.sent,
            done,
            float(injected.group(1)) if injected else float("nan"),
            float(timer.group(1)) if timer else float("nan"),
        )
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(reply)


class KeepAlivePool:
    """Idle keep-alive connections to one host; a new one is opened when none is idle."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.idle: deque[_Connection] = deque()
        self.opened = 0

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(_Connection, self.host, self.port)
        self.opened += 1
        return conn

    async def preopen(self, n: int) -> None:
        for start in range(0, n, 200):
            conns = await asyncio.gather(*(self._open() for _ in range(min(200, n - start))))
            self.idle.extend(conns)

    async def request(self, raw: bytes) -> Reply:
        conn = None
        while self.idle:
            candidate = self.idle.pop()
            if not candidate.closed:
                conn = candidate
                break
        if conn is None:
            conn = await self._open()
        reply = await conn.send(raw)
        if not conn.closed:
            self.idle.append(conn)
        return reply

    def close(self) -> None:
        while self.idle:
            conn = self.idle.pop()
            if conn.transport is not None:
                conn.transport.close()


def post_request(host: str, port: int, path: str, body: bytes) -> bytes:
    """The prepared bytes of one keep-alive JSON POST."""
    return (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
