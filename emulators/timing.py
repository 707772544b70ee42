"""Precise delays on the event loop: sleep to an absolute monotonic target, never per-request threads.

The event loop's timers have about a millisecond of granularity and may fire a little early; we
sleep towards the absolute target and re-check, so the handler never wakes before the target it
asked for and overshoots only by the loop's latency. (A timer that fires a fraction of a
millisecond early costs one more pass of the loop, not a busy wait.)

What a client sees is later still: after the wake-up the reply is built and written. `Pacer`
measures that response path (wake-up overshoot + building + writing) on every paced reply and
wakes the handler that much earlier, so that the reply *leaves* at the scheduled moment. On the
way in, `StampingHttpToolsProtocol` (what `toolenv emulators serve` runs uvicorn with) stamps each
request with when its first byte was parsed, so that the delay counts from when the request
reached the process rather than from when its task got to run (under load, the event loop's
queue sits between the two).
"""

from __future__ import annotations

import asyncio
import time

from starlette.responses import Response
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

RECEIVED_AT = "toolenv.received_at"
"""ASGI scope extension: `time.monotonic()` when the request's first byte was parsed."""


class StampingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus the `RECEIVED_AT` stamp on every request's scope."""

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope["extensions"] = {RECEIVED_AT: time.monotonic()}


def received_at(scope: Scope) -> float:
    """When the request reached this process: the server's stamp, else now (in-process calls)."""
    extensions = scope.get("extensions")
    stamp = extensions.get(RECEIVED_AT) if extensions else None
    return stamp if isinstance(stamp, float) else time.monotonic()


async def sleep_until(target: float) -> float:
    """Sleep until `time.monotonic() >= target`; returns the monotonic time on waking."""
    while True:
        now = time.monotonic()
        remaining = target - now
        if remaining <= 0:
            return now
        await asyncio.sleep(remaining)


class Pacer:
    """The lead to wake with: a running median of how late replies left after their target.

    The median is tracked by stochastic approximation (one step up when a reply left late, one
    down when it left early): O(1) per reply, robust to the odd scheduler stall, and it follows
    the machine's load within a few hundred replies. `lead_s` stays within [0, `max_lead_s`], so
    a stall never makes replies leave early by more than that.
    """

    def __init__(self, step_s: float = 2e-6, max_lead_s: float = 0.002) -> None:
        self.step_s = step_s
        self.max_lead_s = max_lead_s
        self.lead_s = 0.0

    def observe(self, late_s: float) -> None:
        """One reply left `late_s` after its target (negative: early)."""
        if late_s > 0:
            self.lead_s = min(self.max_lead_s, self.lead_s + self.step_s)
        else:
            self.lead_s = max(0.0, self.lead_s - self.step_s)


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
