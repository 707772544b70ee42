"""Straggler policies: when to hedge (a latency quantile of recent calls) and how many retries.

Both are per tool and off by default. Hedging only applies to idempotent tools; retries to
connection errors (the upstream never saw the request) for every tool, and to calls broken
mid-request for idempotent tools only, so neither can run a side effect twice that a caller did
not ask for.
"""

from __future__ import annotations

import time

from toolenv_core.hedging import LatencyWindow as CoreLatencyWindow

from .settings import HedgePolicy, RetryPolicy


class LatencyWindow(CoreLatencyWindow):
    """The shared window (`toolenv_core.hedging`), configured from this gateway's settings."""

    def __init__(self, policy: HedgePolicy) -> None:
        super().__init__(
            policy.quantile,
            window=policy.window,
            min_samples=policy.min_samples,
            min_delay_s=policy.min_delay_ms / 1000.0,
        )
        self.policy = policy


class RetryBudget:
    """Retries allowed: `budget_ratio` per call made, plus a floor of `min_retries_per_s`.

    A budget (rather than "3 retries each") keeps a dead upstream from tripling the load at the
    worst moment: when everything fails, retries are capped at a small fraction of traffic.
    """

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self._balance = 0.0
        # The floor is a token bucket holding at least one retry: one that held only
        # `min_retries_per_s` tokens never reached a whole retry below 1 per second (0.5 allowed
        # none, not one every 2 s). A rate of 0 is no floor.
        rate = policy.min_retries_per_s
        self._floor_cap = max(rate, 1.0) if rate > 0 else 0.0
        self._floor_tokens = self._floor_cap
        self._stamp = time.monotonic()

    def record_call(self) -> None:
        self._balance = min(self._balance + self.policy.budget_ratio, 1000.0)

    def try_spend(self) -> bool:
        now = time.monotonic()
        rate = self.policy.min_retries_per_s
        self._floor_tokens = min(self._floor_cap, self._floor_tokens + (now - self._stamp) * rate)
        self._stamp = now
        if self._balance >= 1:
            self._balance -= 1
            return True
        if self._floor_tokens >= 1:
            self._floor_tokens -= 1
            return True
        return False
