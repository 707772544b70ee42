"""One tool call from the HTTP side, framework-free: context, deadline, trace capture, log line.

Used by the raw ASGI fast path (`passthrough`) for the pass-through routes and the generic call,
so every route answers, forwards, captures and logs alike.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from toolenv_core import headers as h
from toolenv_core.deadline import Deadline

from .dispatch import Outcome, ToolRuntime, UpstreamCall, cancelled_kind
from .trace import TraceWriter

log = logging.getLogger("toolenv.gateway")

FAILURE_STATUS = {"timeout": 504, "rejected": 429, "unavailable": 503, "upstream_failed": 502}
_DEADLINE = h.DEADLINE.lower()
_TRAJECTORY, _STEP, _TURN = h.TRAJECTORY.lower(), h.STEP.lower(), h.TURN.lower()
_FORWARDED = tuple((name, name.lower()) for name in h.FORWARDED_CALL_HEADERS)
_READ = ("Content-Type", h.DEADLINE, *h.FORWARDED_CALL_HEADERS)
# raw lower-cased name -> the key it is kept under (no name decoded per request)
_WANTED = {name.lower().encode(): name.lower() for name in _READ}
_SPELLED = {name.lower(): name for name in _READ}


@dataclass(slots=True)
class CallContext:
    """What a call needs from its HTTP request (the few headers that matter, lower-cased)."""

    request_id: str
    caller: str | None
    headers: dict[str, str]
    trace: TraceWriter | None
    # the call-context headers, checked by `check_headers`
    trajectory: str | None = None
    step: int | None = None
    turn: int | None = None
    # a header read here sent twice with different values (which one counted was a guess)
    sent_twice: str | None = None
    # the gateway's refusals by reason (`guard.Door.refused`, /metrics' refused_total)
    refused: dict[str, int] | None = None

    @classmethod
    def from_scope(
        cls,
        scope: dict[str, Any],
        trace: TraceWriter | None,
        refused: dict[str, int] | None = None,
    ) -> CallContext:
        state = scope.get("state") or {}
        return cls.from_headers(
            scope["headers"], state.get("request_id", ""), state.get("caller"), trace, refused
        )

    @classmethod
    def from_headers(
        cls,
        raw: Iterable[tuple[bytes, bytes]],
        request_id: str,
        caller: str | None,
        trace: TraceWriter | None,
        refused: dict[str, int] | None = None,
    ) -> CallContext:
        """From raw (lower-cased name, value) header pairs, as ASGI and the lane hold them."""
        headers: dict[str, str] = {}
        sent_twice = None
        for name, value in raw:
            key = _WANTED.get(name)
            if key is not None:
                text = value.decode("latin-1")
                if headers.setdefault(key, text) != text:
                    sent_twice = sent_twice or key
        return cls(request_id, caller, headers, trace, sent_twice=sent_twice, refused=refused)

    def refuse(self, reason: str) -> None:
        """Counts this request as refused before its tool, for `reason` (a `metrics.REFUSALS`)."""
        if self.refused is not None:
            self.refused[reason] += 1

    @property
    def sent_deadline(self) -> bool:
        return _DEADLINE in self.headers

    def check_headers(self) -> None:
        """Parse the call-context headers the gateway reads (before the tool is called): one it
        would record wrongly is the caller's mistake, a 400; raises HeaderError naming it."""
        if self.sent_twice is not None:  # the last one counted: a proxy's and the caller's, say
            raise h.HeaderError(
                f"{_SPELLED[self.sent_twice]} was sent twice with different values: send it once"
            )
        self.trajectory = h.trajectory_header(self.headers.get(_TRAJECTORY))
        self.step = h.count_header(h.STEP, self.headers.get(_STEP))
        self.turn = h.count_header(h.TURN, self.headers.get(_TURN))

    def deadline(
        self, runtime: ToolRuntime, body_ms: float | None = None
    ) -> tuple[Deadline, float]:
        """The call's deadline (header and body: the earlier wins); raises DeadlineHeaderError."""
        return runtime.deadline_for(self.headers.get(_DEADLINE), body_ms)


async def run_call(
    ctx: CallContext,
    runtime: ToolRuntime,
    path: str,
    body: bytes,
    deadline: Deadline,
    deadline_ms: float,
    reserve_s: float = 0.0,
    content_type: str | None = None,
) -> Outcome:
    """Send one call to the tool, with the call-context headers (trajectory, step, turn) passed on,
    so a tool behind the gateway sees what the caller said (a drifting profile, the training step).
    The tool is told the deadline `reserve_s` early (see `UpstreamCall`). `content_type`: of a
    body the gateway wrote (None: the caller's body as is, with the caller's content type)."""
    sent = ctx.headers  # lower-cased names
    headers = {
        "content-type": content_type or sent.get("content-type", "application/json"),
        h.REQUEST_ID: ctx.request_id,
    }
    for name, lower in _FORWARDED:
        value = sent.get(lower)
        if value is not None:
            headers[name] = value
    call = UpstreamCall("POST", path, body, headers, deadline, reserve_s)
    started = time.perf_counter()
    try:
        outcome = await runtime.call(call, deadline_ms)
    except asyncio.CancelledError:  # the caller hung up (or the shutdown cut it): still a call,
        elapsed = time.perf_counter() - started  # captured and logged
        gone = Outcome(
            cancelled_kind(), elapsed_s=elapsed, queue_wait_s=call.queue_wait_s,
            deadline_ms=deadline_ms,
        )  # fmt: skip
        _capture(ctx, runtime, gone)
        _log(ctx, runtime, gone)
        raise
    _capture(ctx, runtime, outcome)
    _log(ctx, runtime, outcome)
    return outcome


def failure_answer(
    runtime: ToolRuntime, outcome: Outcome, request_id: str
) -> tuple[int, dict[str, Any], dict[str, str] | None]:
    """(status, JSON body, headers) of a call that got no answer from its tool."""
    body: dict[str, Any] = {
        "tool": runtime.name,
        "status": outcome.kind,
        "error": outcome.error,
        "elapsed_s": round(outcome.elapsed_s, 6),
        "request_id": request_id,
    }
    if outcome.kind == "timeout":
        body["deadline_ms"] = outcome.deadline_ms
    headers = {"Retry-After": outcome.retry_after} if outcome.retry_after else None
    return FAILURE_STATUS[outcome.kind], body, headers


def _capture(ctx: CallContext, runtime: ToolRuntime, outcome: Outcome) -> None:
    trajectory = ctx.trajectory
    if ctx.trace is None or not trajectory:
        return
    ctx.trace.record(
        {
            "tool_name": runtime.name,
            "turn": ctx.turn or 0,
            "latency_s": outcome.elapsed_s,
            "status": "success" if outcome.kind == "ok" else outcome.kind,
            "response_bytes": len(outcome.reply.body) if outcome.reply is not None else 0,
            "trajectory_id": trajectory,
            "step": ctx.step,
        }
    )


def _log(ctx: CallContext, runtime: ToolRuntime, outcome: Outcome) -> None:
    # Successes and 429s are the bulk under load: logging each would cost more than the call.
    level = logging.DEBUG if outcome.kind in ("ok", "rejected") else logging.INFO
    if not log.isEnabledFor(level):
        return
    reply = outcome.reply
    log.log(
        level,
        "tool call",
        extra={
            "request_id": ctx.request_id,
            "tool": runtime.name,
            "outcome": outcome.kind,
            "status": reply.status if reply is not None else None,
            "elapsed_ms": round(outcome.elapsed_s * 1000, 3),
            "queue_wait_ms": round(outcome.queue_wait_s * 1000, 3),
            "upstream": reply.endpoint if reply is not None else None,
            "error": outcome.error,
            "caller": ctx.caller,
        },
    )
