"""When to hedge a call: a latency quantile of the recent successful calls to the same tool.

The gateway hedges idempotent upstream calls with it, and the rollout simulator models the
gateway's hedging with the very same object, so a study's "hedge at p95" means what serving does.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class LatencyWindow:
    """The last `window` successful latencies, and a cached quantile of them."""

    def __init__(
        self,
        quantile: float,
        *,
        window: int = 512,
        min_samples: int = 20,
        min_delay_s: float = 0.005,
    ) -> None:
        if not 0 < quantile < 1:
            raise ValueError("the hedge quantile must be in (0, 1)")
        self.quantile = quantile
        self.min_samples = min_samples
        self.min_delay_s = min_delay_s
        self._samples: deque[float] = deque(maxlen=window)
        self._cached: float | None = None
        self._since_cache = 0

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)
        self._since_cache += 1

    def hedge_delay(self) -> float | None:
        """Seconds after which to send a hedge; None while there are too few samples."""
        if len(self._samples) < self.min_samples:
            return None
        # Recompute at most every 16 samples: the quantile moves slowly and numpy is not free.
        if self._cached is None or self._since_cache >= 16:
            self._cached = float(np.quantile(np.fromiter(self._samples, float), self.quantile))
            self._since_cache = 0
        return max(self._cached, self.min_delay_s)


# A failure held while another attempt of the call still runs is answered this long before the
# call's deadline, so that the gateway's own deadline timer does not turn it into a timeout.
HELD_FAILURE_MARGIN_S = 0.01


def another_attempt_may_do_better(status: int) -> bool:
    """Whether an attempt's answer should wait for a hedge still running rather than win the
    race: a 5xx or a throttle's 429 may be one upstream's trouble (Envoy and gRPC hedging wait
    likewise), while another 4xx is the call's own fault and any upstream would answer it."""
    return status >= 500 or status == 429
