"""The hot routes served straight from the connection: a uvicorn HTTP protocol with a lane.

Why: under uvicorn every request costs a scope, a request-response cycle with its event and task,
two ASGI messages checked header by header and two socket writes before any app code runs, about
as much CPU as the rest of a proxied call together. For a `POST` to a hot route (`/run_code`,
`/v1/run_tests`, `/retrieve`, `/v1/tools/{tool}/call`) this protocol keeps the parsed headers and
body itself, applies the front door (`guard.Door`: keys, rate limits, body limit, request id) and
runs the one implementation of the call (`passthrough.serve`) in a task, writing the answer with
one socket write. Everything else takes uvicorn's own path to the app: other routes, and requests
the lane leaves alone (no Content-Length, `Expect: 100-continue`, a percent-encoded path, a
request pipelined behind one still being answered), which the app's `PassThrough` middleware
serves with the same functions.

A lane call stands in uvicorn's place for a cycle (`LaneCycle`), so uvicorn's keep-alive timer,
pipelining queue, write flow control (an answer the client has not taken holds the next request),
graceful shutdown (it waits for the lane's tasks, and closes the connection
after the answer) and disconnect handling all apply to it unchanged.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from toolenv_core.disconnect import cancel_for_caller
from toolenv_core.headbound import HeadBound

from .calls import CallContext
from .guard import REQUEST_ID_KEY, Verdict
from .passthrough import HotCall, cut_answer, hot_call, serve
from .state import GatewayState

log = logging.getLogger("toolenv.gateway")
JSON = (b"content-type", b"application/json")
_ERROR = b"Internal Server Error"
_TASK_NAME = "gateway-lane"


@dataclass(eq=False, slots=True)
class _Signal:
    """What uvicorn sets on a cycle's message event when the client goes away (nobody waits)."""

    is_set: bool = False

    def set(self) -> None:
        self.is_set = True


@dataclass(eq=False, slots=True)
class LaneCycle:
    """One request on the lane, from its headers to its answer; shaped like uvicorn's cycle in
    the few fields uvicorn's protocol reads and writes on the cycle it holds."""

    call: HotCall
    verdict: Verdict
    headers: list[tuple[bytes, bytes]]
    keep_alive: bool
    body: bytearray = field(default_factory=bytearray)
    response_complete: bool = False
    disconnected: bool = False
    message_event: _Signal = field(default_factory=_Signal)
    body_timer: asyncio.TimerHandle | None = None  # the body's deadline (Door.body_timeout_s)
    task: asyncio.Task[None] | None = None  # answering it, once the body is in


class LaneProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with the hot routes served on the connection itself."""

    def __init__(self, *args: Any, gateway: GatewayState, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gateway = gateway
        self.lane: LaneCycle | None = None  # the lane request being read, until it is complete
        self.idle_since: float | None = None  # loop time the last answer went out, while idle

    # -- parser callbacks (uvicorn's, with the lane first)
    def on_message_begin(self) -> None:
        """uvicorn's, less the ASGI scope: built only for a request the lane leaves to the app."""
        self.url = b""
        self.expect_100_continue = False
        self.headers = []

    def on_headers_complete(self) -> None:
        lane = self._take()
        if lane is None:
            self._new_scope()
            super().on_headers_complete()
            return
        self.lane = lane
        self.cycle = lane  # type: ignore[assignment]  # uvicorn sees a cycle in progress
        verdict = lane.verdict
        if verdict.status:
            # Refused at its headers (a missing or wrong key, the rate limit, a body declared
            # larger than the limit): answered now, not once the body is in, as the app's path
            # answers (it may never come: a wrong key with a large or slow body was a 408 after
            # the body timeout, counted twice). What arrives of the body is dropped until it
            # ends or its time is up; then the connection is kept, but after a 413 closed (closed
            # at once, a client still sending could get a reset instead of this answer).
            if verdict.status == 413:
                lane.keep_alive = False
            self._write(lane, verdict.status, [JSON, *verdict.headers], verdict.refusal_body())
            lane.response_complete = True

    def _new_scope(self) -> None:
        """The scope uvicorn's `on_message_begin` makes (what was parsed since kept)."""
        url, headers, expect = self.url, self.headers, self.expect_100_continue
        HttpToolsProtocol.on_message_begin(self)
        self.url, self.expect_100_continue = url, expect
        self.headers = self.scope["headers"] = headers

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        lane = self.lane
        if lane is not None and lane.body_timer is None and not self.transport.is_closing():
            # A lane request still incomplete after this chunk: its body now has a deadline
            # (armed here rather than per request: nearly every request arrives in one chunk).
            lane.body_timer = self.loop.call_later(
                self.gateway.door.body_timeout_s, self._body_late, lane
            )

    def on_body(self, body: bytes) -> None:
        lane = self.lane
        if lane is None:
            super().on_body(body)
        elif not lane.verdict.status:
            lane.body += body  # a refused request's body is read and dropped

    def on_message_complete(self) -> None:
        lane = self.lane
        if lane is None:
            super().on_message_complete()
            return
        self.lane = None
        if lane.body_timer is not None:
            lane.body_timer.cancel()
        if lane.response_complete:  # refused at its headers: answered already
            if not lane.keep_alive:
                self.transport.close()
            self.on_response_complete()
            return
        # named: an unnamed task formats "Task-<n>" for its name, on every call
        task = asyncio.Task(self._answer(lane), loop=self.loop, name=_TASK_NAME)
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)
        lane.task = task

    def connection_lost(self, exc: Exception | None) -> None:
        """uvicorn's, and a lane call whose caller hung up before its answer is cancelled: its
        tool's work stops (the upstream connection closed, an in-process handler unwound: a
        sandbox kills its program) and its slot is free, rather than held for nobody."""
        lane = self.cycle
        super().connection_lost(exc)
        if isinstance(lane, LaneCycle) and lane.task is not None and not lane.response_complete:
            cancel_for_caller(lane.task)

    # -- keep-alive: one timer per idle spell, not one armed and cancelled per request
    def _unset_keepalive_if_required(self) -> None:
        self.idle_since = None  # data arrived: busy (the timer, if armed, finds it so and lapses)

    def on_response_complete(self) -> None:
        """uvicorn's own, except that the keep-alive timer is armed only if none is."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self.idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self._idle_check
            )

    def _idle_check(self) -> None:
        self.timeout_keep_alive_task = None
        if self.idle_since is None or self.transport.is_closing():
            return  # busy: re-armed when this request is answered
        left = self.idle_since + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self.timeout_keep_alive_task = self.loop.call_later(left, self._idle_check)
        else:
            self.timeout_keep_alive_handler()

    # -- the lane
    def _take(self) -> LaneCycle | None:
        """A lane cycle for this request if it is a hot call the lane can serve whole."""
        if self.parser.get_method() != b"POST" or self.expect_100_continue:
            return None
        if self.cycle is not None and not self.cycle.response_complete:
            return None  # pipelined behind an answer in progress: uvicorn queues it in order
        url = self.url
        query = url.find(b"?")
        raw_path = url if query < 0 else url[:query]
        if b"%" in raw_path or self.parser.should_upgrade():
            return None
        path = raw_path.decode("ascii", "replace")
        call = hot_call(self.gateway, path)
        if call is None:
            return None
        for name, _ in self.headers:
            if name == b"content-length":
                break
        else:
            return None  # a body without Content-Length: the app's guard counts it as it comes
        # once per request; every hot route takes a body: one declared too large is its 413 now
        verdict = self.gateway.door.check(self.headers, path, self.client, takes_body=True)
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        return LaneCycle(call, verdict, self.headers, keep_alive)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request its parser refuses (two Content-Lengths, Content-Length
        with Transfer-Encoding, a folded header, a CR or NUL in a value: how requests are
        smuggled), counted where an operator looks: `invalid_request` (it was in no metric)."""
        self.gateway.door.refused["invalid_request"] += 1
        super().send_400_response(msg)

    def _body_late(self, lane: LaneCycle) -> None:
        """The body did not arrive whole in time (e.g. shorter than its Content-Length): 408,
        and the connection is closed (what is left of the body is never read)."""
        if self.lane is not lane or self.transport.is_closing():
            return
        self.lane = None
        if lane.response_complete:  # refused at its headers: the rest of it is not awaited
            self.transport.close()
            return
        lane.keep_alive = False
        door = self.gateway.door
        door.body_refused(408)
        verdict = lane.verdict
        verdict.status, verdict.detail = (
            408,
            door.body_timeout_message(len(lane.body), lane.headers),
        )
        self._write(lane, 408, [JSON], verdict.refusal_body())
        lane.response_complete = True
        self.transport.close()

    async def _answer(self, lane: LaneCycle) -> None:
        answered = False
        try:
            verdict = lane.verdict
            gateway = self.gateway
            ctx = CallContext.from_headers(
                lane.headers, verdict.request_id, verdict.caller, gateway.trace,
                gateway.door.refused,
            )  # fmt: skip
            answer = await serve(ctx, lane.call, bytes(lane.body))
            self._write(lane, *answer)
            answered = True
            if self.flow.write_paused and not lane.disconnected:
                # as uvicorn's own cycle: complete (and the next request read) once the client
                # takes it; a client that never read its answers grew the write buffer by each
                await self.flow.drain()
        except Exception as exc:  # like uvicorn's own cycle: log it, answer 500
            log.error("gateway lane error", exc_info=exc)
            self._write(lane, 500, [(b"content-type", b"text/plain; charset=utf-8")], _ERROR)
            answered = True
        except asyncio.CancelledError:
            if not lane.disconnected:  # not its caller gone: uvicorn cut it at the grace's end
                lane.keep_alive = False
                status, headers, body = cut_answer(self.gateway, lane.verdict.request_id)
                self._write(lane, status, headers, body)
            raise
        finally:
            lane.response_complete = True
            if not lane.keep_alive or not answered:
                self.transport.close()
            self.on_response_complete()

    def _write(
        self, lane: LaneCycle, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        """Status line, uvicorn's default headers (date, server), `headers` (the content type
        among them, never the content length), content length, request id and body: one write."""
        transport = self.transport
        if lane.disconnected or transport.is_closing():
            return
        parts = [STATUS_LINE[status], _default_block(self.server_state.default_headers)]
        for name, value in headers:
            parts += [name, b": ", value, b"\r\n"]
        parts += [
            b"content-length: ", str(len(body)).encode(), b"\r\n",
            REQUEST_ID_KEY, b": ", lane.verdict.request_id.encode(), b"\r\n",
        ]  # fmt: skip
        if not lane.keep_alive:
            parts.append(b"connection: close\r\n")
        parts += [b"\r\n", body]
        transport.write(b"".join(parts))


_BLOCK: list[Any] = [None, b""]  # uvicorn's default headers (a new list each second), written


def _default_block(default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """uvicorn's default headers (date, server) as one block, written once per list uvicorn
    makes (it replaces the list when the date changes)."""
    if _BLOCK[0] is not default_headers:
        _BLOCK[:] = [default_headers, b"".join(n + b": " + v + b"\r\n" for n, v in default_headers)]
    return _BLOCK[1]


class BoundedLaneProtocol(HeadBound, LaneProtocol):
    """The lane, with every request's head bounded in size and time (`toolenv_core.headbound`)."""


def lane_protocol(gateway: GatewayState) -> Callable[..., LaneProtocol]:
    """What to hand uvicorn as `http=`: its httptools protocol with this gateway's lane and the
    request head bounded."""
    return functools.partial(BoundedLaneProtocol, gateway=gateway)
