"""Precise delays on the event loop: sleep to an absolute monotonic target, never per-request threads.

uvloop's timers keep whole milliseconds (a wake-up lands up to a millisecond late, or early and
slept again), so on Linux every sleep is woken by one timerfd per loop (`toolenv_core.timer.PreciseTimer`):
the handler never wakes before the target it asked for and overshoots only by the loop's latency
(tens of microseconds when it is idle). Elsewhere the loop's own timers are re-checked.

What a client sees is later still: after the wake-up the reply is built and written. `Pacer`
measures that response path (wake-up overshoot + building + writing) on every paced reply and
wakes the handler that much earlier, so that the reply *leaves* at the scheduled moment. On the
way in, `StampingHttpToolsProtocol` (what `toolenv emulators serve` runs uvicorn with) stamps each
request with when its first byte was parsed, so that the delay counts from when the request
reached the process rather than from when its task got to run (under load, the event loop's
queue sits between the two); and the request sat in its socket about as long as the loop takes
to answer a ready fd, which the timer's own overshoot measures (`Pacer.intake_s`), so the delay
counts from that much before the stamp.
"""

from __future__ import annotations

import asyncio
import time

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from toolenv_core.headbound import HeadBound
from toolenv_core.timer import sleep_until

__all__ = [
    "RECEIVED_AT",
    "WATCH_DISCONNECT_S",
    "ClientGone",
    "PacedResponse",
    "Pacer",
    "StampingHttpToolsProtocol",
    "received_at",
    "sleep_or_gone",
]

RECEIVED_AT = "toolenv.received_at"
"""ASGI scope extension: `time.monotonic()` when the request's first byte was parsed."""


class StampingHttpToolsProtocol(HeadBound):
    """uvicorn's httptools protocol with the request head bounded (`toolenv_core.headbound`),
    plus the `RECEIVED_AT` stamp on every request's scope."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {RECEIVED_AT: time.monotonic()}


def received_at(scope: Scope) -> float:
    """When the request reached this process: the server's stamp, else now (in-process calls)."""
    extensions = scope.get("extensions")
    stamp = extensions.get(RECEIVED_AT) if extensions else None
    return stamp if isinstance(stamp, float) else time.monotonic()


class Pacer:
    """How early to wake: the running medians of the response path and of the loop's intake.

    `lead_s` is how late replies left after their target (the wake-up overshoot, building and
    writing the reply): waking that much earlier makes the reply leave on time. `intake_s` is how
    late the loop runs a callback after its fd became ready (the timer's own overshoot): a request
    waits about as long in its socket before it is parsed and stamped, so its delay counts from
    that much before the stamp. Both medians are tracked by stochastic approximation (one step up
    when above, one down when below): O(1) per reply, robust to the odd scheduler stall, and they
    follow the machine's load within a few hundred replies. `early_s` (their sum) stays within
    [0, `max_lead_s`], so a stall never makes replies leave early by more than that.
    """

    def __init__(self, step_s: float = 2e-6, max_lead_s: float = 0.002) -> None:
        self.step_s = step_s
        self.max_lead_s = max_lead_s
        self.lead_s = 0.0
        self.intake_s = 0.0

    @property
    def early_s(self) -> float:
        """How much before `stamp + delay` to wake (0 with pacing off)."""
        return min(self.max_lead_s, self.lead_s + self.intake_s)

    def observe(self, late_s: float) -> None:
        """One reply left `late_s` after its target (negative: early)."""
        if late_s > 0:
            self.lead_s = min(self.max_lead_s, self.lead_s + self.step_s)
        else:
            self.lead_s = max(0.0, self.lead_s - self.step_s)

    def observe_wake(self, overshoot_s: float) -> None:
        """One sleep woke `overshoot_s` after the moment it asked for."""
        if overshoot_s > self.intake_s:
            self.intake_s = min(self.max_lead_s, self.intake_s + self.step_s)
        else:
            self.intake_s = max(0.0, self.intake_s - self.step_s)


class PacedResponse(Response):
    """A response that tells its `Pacer` how late it was written (after its last byte went to
    the server's transport), the measurement the next replies' lead is learnt from."""

    def __init__(
        self,
        content: bytes,
        *,
        status_code: int,
        headers: dict[str, str],
        pacer: Pacer,
        target: float,
        media_type: str = "application/json",
    ) -> None:
        super().__init__(content, status_code, headers, media_type)
        self.pacer = pacer
        self.target = target

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().__call__(scope, receive, send)
        self.pacer.observe(time.monotonic() - self.target)


WATCH_DISCONNECT_S = 1.0
"""Sleeps at least this long stop when the client disconnects; shorter ones are let run (watching
costs a task per call, and `max_delay_s` bounds every sleep anyway)."""


class ClientGone(Exception):
    """The client disconnected while its call slept: there is no one to answer."""


async def sleep_or_gone(until: float, receive: Receive | None) -> float:
    """`sleep_until(until)`, but a long sleep raises `ClientGone` as soon as the client leaves.

    uvicorn does not cancel a request's task when its client disconnects: it only answers the
    next `receive()` with `http.disconnect`. Past the body that call waits until the client goes,
    so a watcher task awaits it and cancels this task; the sleep itself wakes from the timer as
    before (no extra hop on the wake-up path)."""
    if receive is None or until - time.monotonic() < WATCH_DISCONNECT_S:
        return await sleep_until(until)
    task = asyncio.current_task()
    assert task is not None
    state = {"sleeping": True, "gone": False}

    async def watch() -> None:
        message = await receive()
        if message["type"] == "http.disconnect" and state["sleeping"]:
            state["gone"] = True
            task.cancel()

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        return await sleep_until(until)
    except asyncio.CancelledError:
        if state["gone"] and task.uncancel() == 0:  # ours alone (not a shutdown's): not an error
            raise ClientGone from None
        raise
    finally:
        state["sleeping"] = False
        watcher.cancel()
