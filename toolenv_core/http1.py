"""The one lean HTTP/1.1 client: raw keep-alive connections, an asyncio Protocol, httptools parsing.

Why not aiohttp or httpx: on this machine kind their per-request CPU (about 0.4 ms for aiohttp,
httpx tops out near 660 rps on one core) was several times the gateway's own, and a load
generator must spend its CPU on its own bookkeeping. A request is encoded once and written with
one `transport.write`; responses are parsed by httptools (the parser uvicorn uses) in callbacks,
with no task per request.

This module holds the connection (the Protocol and its parsing), request encoding and the error
kinds. Two owners drive the same `Connection`:
- `http1_pool.Pool`: `await pool.request(...)` returns a `Response`; what the gateway's upstream
  calls and health checks use.
- `stress.http.LoadClient`: a callback-driven pool that records per-request times into arrays.

Scope: plain `http://` only, one request at a time per connection (no pipelining), keep-alive
unless the server says `Connection: close`. Content-Length, chunked and read-until-close bodies
are all parsed. A request written into a kept-alive connection that turns out to be closed,
before any answer byte, is the owner's to send again once on a fresh connection (the server
closed it while idle, so it never read the request), as browsers and httpx do; `Pool.request`
with `resend=False` does not (the same silence is what an upstream that read the request and died
before answering leaves: a request that must not run twice is then the owner's failure).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

import httptools

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


# Bytes of an answer's head (status line and headers) at most: past them it is unparsable. One
# endless header made httptools grow that header's value by concatenation, read after read, until
# the timeout: memory without bound and CPU quadratic in it (h11 allows 16 KiB, Node 16 KiB).
MAX_HEAD_BYTES = 1 << 20


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
        "head_bytes",
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
        self.head_bytes = 0  # bytes read while the current answer's head was not yet complete

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        if not self.headers_done:
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD_BYTES:
                self.owner._fail(self, ERR_PROTOCOL)
                return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.owner._fail(self, ERR_PROTOCOL)
        except httptools.HttpParserUpgrade:
            # 101 Switching Protocols: its answer is complete and what follows is not HTTP, so
            # the connection is done (the exception escaped: a traceback on stderr per request)
            if self.rid >= 0:
                self.owner._fail(self, ERR_PROTOCOL)
            else:
                self.abort()

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
        self.head_bytes = 0
        if self.status == 204 or self.status == 304 or 100 <= self.status < 200:
            self.framed = True

    def on_message_complete(self) -> None:
        if 100 <= self.status < 200 and self.status != 101:
            # an interim answer (100 Continue, 103 Early Hints): the final one follows on this
            # connection (it was taken for the answer, and the real one was then dropped)
            self.status, self.captured, self.headers_done = 0, None, False
            return
        self.served += 1
        if self.rid >= 0:  # after a 101 the connection speaks another protocol: never reused
            keep_alive = self.status != 101 and self.parser.should_keep_alive()
            self.owner._complete(self, keep_alive=keep_alive)

    # -- used by the owner
    def send(self, rid: int, data: bytes) -> None:
        self.rid = rid
        self.status = 0
        self.captured = None
        if self.body:
            self.body = bytearray()
        self.headers_done = False
        self.got_bytes = False
        self.head_bytes = 0
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
