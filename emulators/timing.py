"""Precise delays on the event loop: sleep to an absolute monotonic target, never per-request threads.

uvloop's timers keep whole milliseconds (a wake-up lands up to a millisecond late, or early and
slept again), so on Linux every sleep is woken by one timerfd per loop (`PreciseTimer`):
the handler never wakes before the target it asked for and overshoots only by the loop's latency
(tens of microseconds when it is idle). Elsewhere the loop's own timers are re-checked.

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
import ctypes
import heapq
import itertools
import math
import os
import sys
import time
import weakref
from typing import Any

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
    """Sleep until `time.monotonic() >= target`; returns the monotonic time on waking.

    On Linux the wake-up comes from the loop's `PreciseTimer` (a timerfd: nanoseconds); elsewhere
    from the loop's own timers, re-checked until the target has passed."""
    loop = asyncio.get_running_loop()
    timer = precise_timer(loop)
    if timer is not None:
        if target <= time.monotonic():
            return time.monotonic()
        return await timer.at(target)
    while True:
        now = time.monotonic()
        remaining = target - now
        if remaining <= 0:
            return now
        await asyncio.sleep(remaining)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_CLOCK_MONOTONIC, _TFD_TIMER_ABSTIME = 1, 1
_TFD_NONBLOCK, _TFD_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.timerfd_settime.argtypes = [
            ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Itimerspec), ctypes.c_void_p,
        ]  # fmt: skip
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()


class PreciseTimer:
    """Wake-ups at the moment asked, to the microsecond, on the event loop.

    Why: uvloop (libuv) keeps time in whole milliseconds: a timer's delay is rounded to the
    nearest millisecond and the loop sleeps in whole milliseconds, so a wake-up lands anywhere
    from about half a millisecond early (re-checked, then slept again) to a millisecond late. That
    spread, at every request, is most of the emulator's timing error. Here every pending wake-up
    sits in one heap and one timerfd (CLOCK_MONOTONIC, the clock of `time.monotonic()`, absolute
    nanoseconds) is armed for the earliest; the loop watches the fd like a socket, so it wakes
    when the kernel's high-resolution timer fires, never before the target.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        fd = _LIBC.timerfd_create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self.fd = fd
        self._loop = weakref.ref(loop)  # the loop holds this timer (its reader), not the reverse
        self._heap: list[tuple[float, int, asyncio.Future[float]]] = []
        self._seq = itertools.count()
        self._armed = math.inf  # the target the timerfd is armed for
        self._spec = _Itimerspec()
        loop.add_reader(fd, self._fire)

    def at(self, target: float) -> asyncio.Future[float]:
        """A future set to the monotonic time of waking, at `target` or just after."""
        loop = self._loop()
        assert loop is not None
        future: asyncio.Future[float] = loop.create_future()
        heapq.heappush(self._heap, (target, next(self._seq), future))
        if target < self._armed:
            self._arm(target)
        return future

    def _arm(self, target: float) -> None:
        self._armed = target
        value = self._spec.it_value
        value.tv_sec = int(target)
        value.tv_nsec = min(999_999_999, int((target - int(target)) * 1e9) + 1)  # never before
        if _LIBC.timerfd_settime(self.fd, _TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None):
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")

    def _fire(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass
        heap = self._heap
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            future = heapq.heappop(heap)[2]
            if not future.done():  # a cancelled sleeper (its client hung up) is skipped
                future.set_result(now)
        self._armed = math.inf
        if heap:
            self._arm(heap[0][0])


_TIMERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, PreciseTimer] = (
    weakref.WeakKeyDictionary()
)


def precise_timer(loop: asyncio.AbstractEventLoop) -> PreciseTimer | None:
    """This loop's `PreciseTimer` (made on first use), or None where there is no timerfd."""
    timer = _TIMERS.get(loop)
    if timer is None and _LIBC is not None:
        try:
            timer = PreciseTimer(loop)
        except (OSError, NotImplementedError):
            return None
        _TIMERS[loop] = timer
        weakref.finalize(loop, os.close, timer.fd)
    return timer


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
