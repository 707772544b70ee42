"""Helpers for the rollout_client tests: a fake tool client (policy unit tests only) and plans."""

from __future__ import annotations

import asyncio
import time

from rollout_client.gateway_client import ToolOutcome
from rollout_client.workloads.plan import ToolCallPlan, TrajectoryPlan, TurnPlan


class FakeTools:
    """Stands in for the gateway in policy unit tests: sleeps `delay_s`, honours the deadline."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, float]] = []

    async def call(
        self, tool, arguments, *, deadline=None, trajectory_id="", step=0, turn=0
    ) -> ToolOutcome:
        started = time.monotonic()
        self.calls.append((trajectory_id, turn, started))
        delay = float(arguments.get("delay_s", 0.0))
        if tool == "broken":
            return ToolOutcome("error", 0.0, error="tool failed")
        if deadline is not None and delay > deadline.remaining():
            await asyncio.sleep(deadline.remaining())
            return ToolOutcome("timeout", time.monotonic() - started, error="deadline")
        await asyncio.sleep(delay)
        return ToolOutcome("ok", time.monotonic() - started)

    async def close(self) -> None:
        pass


def plan(
    tid: str,
    prompt: int,
    turns: list[tuple[int, float | None]],
    append: int = 8,
    tool: str = "search",
) -> TrajectoryPlan:
    """turns: (output tokens, tool delay after the turn or None for no call)."""
    out = []
    for i, (tokens, delay) in enumerate(turns):
        calls = []
        if delay is not None:
            calls.append(
                ToolCallPlan(
                    tool,
                    {"query": f"{tid} {i}", "delay_s": delay},
                    append,
                    recorded_latency_s=delay,
                )
            )
        out.append(TurnPlan(tokens, calls, "tool_calls" if calls else "stop"))
    return TrajectoryPlan(tid, prompt, out)
