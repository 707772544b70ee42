"""Admission control: a concurrency limit with a bounded FIFO queue, and token-bucket rate limits.

Why not an unbounded semaphore: a silent queue turns overload into timeouts for everyone. Here a
caller either gets a slot, waits in a queue of known length (the wait bounded by the queue
timeout and by its own deadline), or is refused at once with a Retry-After estimate. The gateway
(one queue per tool) and sandboxd (one queue for all programs) use the same class.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from .deadline import Deadline


class Rejected(Exception):
    """No slot and the queue is full, the wait ran out (or a rate limit is exhausted)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))


class ExpiredInQueue(Exception):
    """The caller's deadline ran out while the call waited for a slot: a timeout, not
    backpressure (no Retry-After: the caller has no time left to retry in)."""


class Admission:
    """`limit` calls at once, up to `queue_bound` more waiting in FIFO order.

    `queue_timeout_s` bounds a wait (None: only the caller's deadline does); `retry_after_s`
    fixes the Retry-After sent with a refusal (None: estimated from the recent service time).
    """

    def __init__(
        self,
        name: str,
        limit: int,
        queue_bound: int,
        *,
        queue_timeout_s: float | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        self.name = name
        self.limit = limit
        self.queue_bound = queue_bound
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.admitted_total = 0
        self.rejected_total = 0
        self.expired_total = 0  # waits the caller's deadline ended (`ExpiredInQueue`)
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._mean_service_s = 0.05  # exponentially weighted, for Retry-After

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_acquire(self) -> bool:
        if self.in_flight < self.limit and not self._waiters:
            self.in_flight += 1
            self.admitted_total += 1
            return True
        return False

    def _reject(self, why: str) -> Rejected:
        self.rejected_total += 1
        return Rejected(why, self.retry_after_estimate())

    async def acquire(self, deadline: Deadline | None = None, *, committed: bool = False) -> None:
        """Take a slot, waiting in the queue if needed; `Rejected` when full or the queue timeout
        ran out, `ExpiredInQueue` when the caller's deadline did. A `committed` caller (one that
        already holds finished work a refusal would throw away) is never refused: only its
        deadline bounds its wait."""
        if self.try_acquire():
            return
        if len(self._waiters) >= self.queue_bound and not committed:
            raise self._reject(
                f"{self.name} is saturated: {self.in_flight} in flight and "
                f"{len(self._waiters)} queued (limits {self.limit} and {self.queue_bound}); "
                "retry later"
            )
        wait = (
            self.queue_timeout_s if self.queue_timeout_s is not None and not committed else math.inf
        )
        by_deadline = deadline is not None and deadline.remaining() <= wait
        if deadline is not None:
            wait = min(wait, deadline.remaining())
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for returned a slot handed over
            # in the loop turn the caller was cancelled in, dropping the cancellation (a cancelled
            # run_tests case then ran its program anyway)
            async with asyncio.timeout(None if math.isinf(wait) else wait):
                await asyncio.shield(waiter)
        except TimeoutError:
            if waiter.done():  # granted at the last moment: keep it
                self.admitted_total += 1
                return
            self._forget(waiter)
            if by_deadline:
                self.expired_total += 1
                raise ExpiredInQueue(
                    f"{self.name}: the call's deadline ran out after {wait:.3g} s waiting for a "
                    f"slot ({self.in_flight} in flight, {len(self._waiters)} queued)"
                ) from None
            raise self._reject(
                f"{self.name}: no slot within {wait:.3g} s ({self.in_flight} in flight, "
                f"{len(self._waiters)} queued)"
            ) from None
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed to us just as we were cancelled: pass it on
            else:
                self._forget(waiter)
            raise
        self.admitted_total += 1

    def _forget(self, waiter: asyncio.Future[None]) -> None:
        waiter.cancel()
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def release(self, service_s: float | None = None) -> None:
        if service_s is not None:
            self._mean_service_s = 0.9 * self._mean_service_s + 0.1 * service_s
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the next caller
                return
        self.in_flight -= 1

    @asynccontextmanager
    async def slot(
        self, deadline: Deadline | None = None, *, committed: bool = False
    ) -> AsyncIterator[None]:
        await self.acquire(deadline, committed=committed)
        try:
            yield
        finally:
            self.release()

    def retry_after_estimate(self) -> float:
        if self.retry_after_s is not None:
            return self.retry_after_s
        return self._mean_service_s * (len(self._waiters) + 1) / self.limit

    def status(self) -> dict[str, Any]:
        return {
            "capacity": self.limit,
            "running": self.in_flight,
            "waiting": self.waiting,
            "queue_size": self.queue_bound,
            "admitted_total": self.admitted_total,
            "rejected_total": self.rejected_total,
            "expired_total": self.expired_total,
        }


class TokenBucket:
    """`rate` tokens per second up to `burst`; one token per call."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.stamp = time.monotonic()

    def take(self) -> float:
        """0 when a token was taken, else the seconds until one will be there."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


class RateLimits:
    """One token bucket per API key (or per client address when the gateway is open)."""

    def __init__(self, rate: float, burst: float, max_keys: int = 100_000) -> None:
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: dict[str, TokenBucket] = {}

    def check(self, key: str) -> None:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                self._buckets.clear()  # bounded memory beats perfect fairness under a key flood
            bucket = self._buckets[key] = TokenBucket(self.rate, self.burst)
        wait = bucket.take()
        if wait > 0:
            raise Rejected(f"rate limit of {self.rate:g} calls/s exceeded; retry later", wait)
