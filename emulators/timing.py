"""Precise delays on the event loop: sleep to an absolute monotonic target, never per-request threads.

The event loop's timers have about a millisecond of granularity and may fire a little early; we
sleep towards the absolute target and re-check, so the realized delay is never shorter than the
scheduled one and overshoots only by the loop's latency.
"""

from __future__ import annotations

import asyncio
import time

EARLY_TOLERANCE_S = 0.0002


async def sleep_until(target: float) -> float:
    """Sleep until `time.monotonic() >= target - 0.2 ms`; returns the monotonic time on waking."""
    while True:
        now = time.monotonic()
        remaining = target - now
        if remaining <= EARLY_TOLERANCE_S:
            return now
        await asyncio.sleep(remaining)
