"""The straggler policies as an operator configures them: every legal setting does what it says."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.policies import RetryBudget
from gateway.settings import RetryPolicy, ToolConfig


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_retry_floor_below_one_per_second_still_allows_its_retries(monkeypatch) -> None:
    """`min_retries_per_s: 0.5` is one retry every 2 s; its bucket held at most 0.5 tokens, so
    it never allowed one (and the refusal said "plus 0.5 per second")."""
    clock = Clock()
    monkeypatch.setattr("gateway.policies.time.monotonic", clock)
    budget = RetryBudget(RetryPolicy(enabled=True, budget_ratio=0, min_retries_per_s=0.5))
    granted = 0
    for _ in range(100):  # 10 s, a look every 0.1 s
        granted += budget.try_spend()
        clock.now += 0.1
    assert granted in (5, 6), granted  # one at once, then one every 2 s
    none = RetryBudget(RetryPolicy(enabled=True, budget_ratio=0, min_retries_per_s=0))
    clock.now += 60
    assert not none.try_spend()  # a floor of 0 is no floor


def test_a_hedge_window_smaller_than_min_samples_is_refused() -> None:
    """A window that keeps fewer latencies than `min_samples` needs never hedged a call."""
    with pytest.raises(ValidationError, match=r"min_samples \(20\) is more than the window"):
        ToolConfig(name="search", kind="search", hedge={"enabled": True, "window": 10})
    ok = ToolConfig(name="search", kind="search", hedge={"enabled": True, "window": 20})
    assert ok.hedge.min_samples == ok.hedge.window == 20
