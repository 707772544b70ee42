"""Admission: at most `capacity` programs run at once; at most `queue_size` wait, FIFO.

A request beyond the queue, or one that waited longer than `queue_timeout_s` (or past its own
deadline), is refused with `Overloaded`, which the HTTP layer answers with 429 + Retry-After.
Running at most a bounded number of programs keeps throughput flat as offered concurrency grows
(SandboxFusion starts every request's process at once and thrashes).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from toolenv_core.deadline import Deadline


class Overloaded(Exception):
    """No slot within the queue bound or the wait limit; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Admission:
    def __init__(
        self, capacity: int, queue_size: int, queue_timeout_s: float, retry_after_s: int
    ) -> None:
        self.capacity = capacity
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.running = 0
        self.admitted_total = 0
        self.rejected_total = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _reject(self, why: str) -> Overloaded:
        self.rejected_total += 1
        return Overloaded(why, self.retry_after_s)

    async def acquire(self, deadline: Deadline) -> None:
        if self.running < self.capacity and not self._waiters:
            self.running += 1
            self.admitted_total += 1
            return
        if len(self._waiters) >= self.queue_size:
            raise self._reject(
                f"sandbox at capacity: {self.running} running, {len(self._waiters)} queued "
                f"(queue_size {self.queue_size})"
            )
        wait = min(self.queue_timeout_s, deadline.remaining())
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), wait)
        except TimeoutError:
            if fut.done():  # granted at the last moment: keep it
                self.admitted_total += 1
                return
            self._waiters.remove(fut)
            fut.cancel()
            raise self._reject(
                f"no sandbox slot within {wait:.3g} s ({self.running} running, "
                f"{len(self._waiters)} queued)"
            ) from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release_one()  # the slot was handed to us: pass it on
            else:
                self._waiters.remove(fut)
                fut.cancel()
            raise
        self.admitted_total += 1

    def _release_one(self) -> None:
        # Hand the slot straight to the oldest waiter: `running` stays the same.
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.running -= 1

    def release(self) -> None:
        self._release_one()

    @asynccontextmanager
    async def slot(self, deadline: Deadline) -> AsyncIterator[None]:
        await self.acquire(deadline)
        try:
            yield
        finally:
            self.release()

    def status(self) -> dict[str, Any]:
        return {
            "capacity": self.capacity,
            "running": self.running,
            "waiting": self.waiting,
            "queue_size": self.queue_size,
            "admitted_total": self.admitted_total,
            "rejected_total": self.rejected_total,
        }
