"""Wake-ups at an absolute monotonic moment, to the microsecond, on an asyncio event loop.

uvloop (libuv) keeps its timers in whole milliseconds: a delay is rounded to the nearest
millisecond and the loop sleeps in whole milliseconds, so a wake-up lands anywhere from about half
a millisecond early to a millisecond late. Where that matters (the emulators' injected delays, the
load generator's send schedule) `sleep_until` wakes from one timerfd per loop (`PreciseTimer`),
never before the target; elsewhere (no timerfd) the loop's own timers are re-checked.
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
