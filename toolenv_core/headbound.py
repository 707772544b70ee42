"""A request head's two bounds on every service's connections: at most `MAX_HEAD_BYTES` (else
431) and whole within `HEAD_TIMEOUT_S` (else 408), the connection closed after either; and
pipelined requests read no faster than they are answered.

Why: uvicorn's httptools protocol bounds neither. A header of 200 MB was read whole into memory
(300 MB more RSS per connection, then a 200 answer), and a connection that sent nothing, or its
headers a byte a second, was held open for ever (uvicorn's keep-alive timer runs only between
requests): a few thousand of them take every file descriptor the process has. The body has its
own bounds (`toolenv_core.bodylimit`) once the head is in.

Counting costs nothing on the usual path: a head that arrives in one read (nearly all of them)
arms no timer and is counted by no one; only a head still incomplete after a read is.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEAD_TIMEOUT_S = (
    10.0  # the request line and headers, from the connection or the request's first byte
)
MAX_HEAD_BYTES = 64 * 1024  # the request line and headers together (h11's own bound is 16 KiB)

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


def head_timeout_message(timeout_s: float) -> str:
    return (
        f"the request line and headers did not arrive within {timeout_s:g} s; "
        "the connection is closed"
    )


def head_too_large_message(max_bytes: int) -> str:
    return (
        f"the request line and headers exceed the limit of {max_bytes} bytes; "
        "the connection is closed"
    )


def refusal(status: int, detail: str) -> bytes:
    """A whole `{"detail": ...}` answer that closes the connection."""
    body = json.dumps({"detail": detail}).encode()
    return b"".join(
        [
            b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status]),
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        ]
    )


class HeadBound(HttpToolsProtocol):
    """uvicorn's httptools protocol with the request head bounded. Put it first among the bases
    of a protocol that overrides uvicorn's callbacks (its own call the next class's)."""

    head_timeout_s = HEAD_TIMEOUT_S
    max_head_bytes = MAX_HEAD_BYTES
    reading_head = False  # between a request's first byte (or the connection) and its headers
    head_bytes = 0  # of the head being read (a later request's: from the read after its first byte)
    head_begun = False  # a later request's head began in the read being parsed
    head_timer: asyncio.TimerHandle | None = None
    body_pending = False  # from a request's headers to the end of its body
    rest_timer: asyncio.TimerHandle | None = None  # the rest of a body answered before its end

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.reading_head = True  # a connection that never sends a request is closed in time
        self.head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def data_received(self, data: bytes) -> None:
        self.head_begun = False
        super().data_received(data)
        if not self.reading_head or self.transport.is_closing():
            return
        # the head still incomplete after this read: all of the read was head, unless a later
        # request began in it (behind the end of the one before: that head counts from the next)
        if not self.head_begun:
            self.head_bytes += len(data)
            if self.head_bytes > self.max_head_bytes:
                self._refuse(431, head_too_large_message(self.max_head_bytes))
                return
        if self.head_timer is None:
            self.head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self.reading_head:  # a request after the first (the first's counts from the start)
            self.reading_head = True
            self.head_bytes = 0
            self.head_begun = True

    def on_headers_complete(self) -> None:
        self.reading_head = False
        self.body_pending = True
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self.body_pending = False
        if self.rest_timer is not None:
            self.rest_timer.cancel()
            self.rest_timer = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.body_pending and self.rest_timer is None and not self.transport.is_closing():
            # Answered before its body was whole (a 401, a 404, a chunked body's 413): uvicorn
            # reads the rest and drops it, to keep the connection, with no bound in time, so a
            # caller trickling it (no key needed) held the connection for ever. Closed unless the
            # rest arrives within the head's timeout.
            self.rest_timer = self.loop.call_later(self.head_timeout_s, self._rest_late)
        if self.pipeline and not self.transport.is_closing():
            # uvicorn resumed reading at every answer, requests still queued behind it: a client
            # pipelining without reading its answers had every one let in another read
            # (560 thousand queued GETs, +700 MB, in 10 s). Read again once the queue is done.
            self.flow.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self.head_timer, self.rest_timer):
            if timer is not None:
                timer.cancel()
        self.head_timer = self.rest_timer = None
        super().connection_lost(exc)

    def _rest_late(self) -> None:
        self.rest_timer = None
        if self.body_pending:
            self.transport.close()

    def _head_late(self) -> None:
        self.head_timer = None
        if not self.reading_head or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # pipelined behind an answer still being written: the head's clock starts again
            self.head_timer = self.loop.call_later(self.head_timeout_s, self._head_late)
        elif self.cycle is None and self.head_bytes == 0:
            self.transport.close()  # never sent a byte: closed as an idle keep-alive is
        else:
            self._refuse(408, head_timeout_message(self.head_timeout_s))

    def _refuse(self, status: int, detail: str) -> None:
        self.reading_head = False
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.write(refusal(status, detail))  # else mid-answer: only closed
        self.transport.close()
