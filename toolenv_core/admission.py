"""Admission control: a concurrency limit with a bounded FIFO queue, and token-bucket rate limits.

Why not an unbounded semaphore: a silent queue turns overload into timeouts for everyone. Here a
caller either gets a slot, waits in a queue of known length (the wait counts against its
deadline), or is refused at once with a Retry-After estimate.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque


class Rejected(Exception):
    """No slot and the queue is full (or a rate limit is exhausted)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def retry_after_header(self) -> str:
        return str(max(1, math.ceil(self.retry_after_s)))


class Admission:
    """`limit` calls at once, up to `queue_bound` more waiting in FIFO order."""

    def __init__(self, name: str, limit: int, queue_bound: int) -> None:
        self.name = name
        self.limit = limit
        self.queue_bound = queue_bound
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._mean_service_s = 0.05  # exponentially weighted, for Retry-After

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_acquire(self) -> bool:
        if self.in_flight < self.limit and not self._waiters:
            self.in_flight += 1
            return True
        return False

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if needed; raises `Rejected` when the queue is full."""
        if self.try_acquire():
            return
        if len(self._waiters) >= self.queue_bound:
            raise Rejected(
                f"tool {self.name!r} is saturated: {self.in_flight} calls in flight and "
                f"{len(self._waiters)} queued (limits {self.limit} and {self.queue_bound}); retry later",
                self.retry_after_estimate(),
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed to us just as we were cancelled: pass it on
            else:
                try:
                    self._waiters.remove(waiter)
                except ValueError:
                    pass
            raise

    def release(self, service_s: float | None = None) -> None:
        if service_s is not None:
            self._mean_service_s = 0.9 * self._mean_service_s + 0.1 * service_s
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the next caller
                return
        self.in_flight -= 1

    def retry_after_estimate(self) -> float:
        return self._mean_service_s * (len(self._waiters) + 1) / self.limit


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
