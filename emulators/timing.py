"""Precise delays on the event loop: sleep to an absolute monotonic target, never per-request threads.

The event loop's timers have about a millisecond of granularity and may fire a little early; we
sleep towards the absolute target and re-check, so the realized delay is never shorter than the
scheduled one and overshoots only by the loop's latency. (A timer that fires a fraction of a
millisecond early costs one more pass of the loop, not a busy wait.)
"""

from __future__ import annotations

import asyncio
import time


async def sleep_until(target: float) -> float:
    """Sleep until `time.monotonic() >= target`; returns the monotonic time on waking."""
    while True:
        now = time.monotonic()
        remaining = target - now
        if remaining <= 0:
            return now
        await asyncio.sleep(remaining)
