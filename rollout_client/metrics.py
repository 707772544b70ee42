"""Per-step rollout metrics, computed from the step outcome and the engine's in-flight timeline.

- makespan: step start to step close;
- throughput: completed trajectories/s and generated tokens/s (wasted ones included);
- engine busy fraction (share of the step with at least one request in flight) and mean batch
  occupancy (time-weighted requests in flight / engine capacity): the GPU-idle proxy;
- time split, summed over trajectories: generating, queueing (submit to first token), waiting on
  tools, waiting at the sync barrier;
- tail share: the share of the makespan taken by the last 10% of completed trajectories;
- timeouts, tool errors, calls abandoned in flight at the step close, aborted and carried trajectories, staleness distribution, wasted tokens.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from .engines.base import EngineMonitor
from .runner import StepOutcome


def step_metrics(outcome: StepOutcome, monitor: EngineMonitor) -> dict[str, Any]:
    makespan = max(1e-9, outcome.ended - outcome.started)
    busy, occupancy = monitor.window(outcome.started, outcome.ended)
    completions = sorted(s.finished_at for s in outcome.done if s.finished_at is not None)
    tokens = sum(s.times.tokens for s in outcome.states)
    split = {
        "generate_s": sum(s.times.generate_s for s in outcome.states),
        "queue_s": sum(s.times.queue_s for s in outcome.states),
        "tool_wait_s": sum(s.times.tool_s for s in outcome.states),
        "barrier_wait_s": sum(s.times.barrier_s for s in outcome.states),
    }
    total = sum(split.values()) or 1e-9
    tail_share = 0.0
    if completions:
        p90 = float(np.percentile(completions, 90, method="lower"))
        tail_share = (makespan - p90) / makespan
    staleness = Counter(s.staleness for s in outcome.done)
    calls = [c for s in outcome.states for c in s.calls if c.step == outcome.step]
    return {
        "step": outcome.step,
        "launched": outcome.launched,
        "completed": len([s for s in outcome.done if s.status == "done"]),
        "failed": len([s for s in outcome.done if s.status == "failed"]),
        "failures": sorted({s.error for s in outcome.done if s.status == "failed" and s.error})[:3],
        "carried": len(outcome.carried),
        "aborted": len(outcome.aborted),
        "makespan_s": round(makespan, 4),
        "trajectories_per_s": round(
            len([s for s in outcome.done if s.status == "done"]) / makespan, 4
        ),
        "generated_tokens": tokens,
        "tokens_per_s": round(tokens / makespan, 2),
        "engine_busy_fraction": round(busy, 4),
        "engine_idle_fraction": round(1 - busy, 4),
        "mean_batch_occupancy": round(occupancy, 4),
        "mean_in_flight": round(occupancy * monitor.capacity, 2),
        "capacity": monitor.capacity,
        "time_split_s": {k: round(v, 3) for k, v in split.items()},
        "time_share": {k.removesuffix("_s"): round(v / total, 4) for k, v in split.items()},
        "tail_share": round(tail_share, 4),
        # Calls, timeouts and errors over the same set: every call made in this step, by
        # trajectories finished, carried over or aborted alike (what the progress bar counts).
        "tool_calls": len(calls),
        "tool_timeouts": sum(1 for c in calls if c.status == "timeout"),
        "tool_errors": sum(1 for c in calls if c.status == "error"),
        # Not in `tool_calls`: cancelled unanswered when the step closed (over-sampling).
        "tool_calls_abandoned": outcome.abandoned_calls,
        "wasted_tokens": outcome.wasted_tokens,
        "staleness": {str(k): v for k, v in sorted(staleness.items())},
        "completion_times_s": [round(t, 4) for t in completions],
        "prefix_cache": (
            {
                "queries": outcome.prefix_cache.queries,
                "hits": outcome.prefix_cache.hits,
                "hit_rate": round(outcome.prefix_cache.hit_rate, 4),
            }
            if outcome.prefix_cache is not None
            else None
        ),
    }


def in_modelled_time(metrics: dict[str, Any], time_scale: float) -> dict[str, Any]:
    """A step's metrics from a clock that ran `time_scale` times faster (the sim at --time-scale),
    in modelled seconds: its times multiplied and its rates divided by the scale, so that
    trajectories/s sits beside the modelled makespan it comes from (it was the wall rate, X times
    the modelled one)."""
    if time_scale == 1.0:
        return metrics
    return {
        **metrics,
        "makespan_s": round(metrics["makespan_s"] * time_scale, 4),
        "trajectories_per_s": round(metrics["trajectories_per_s"] / time_scale, 4),
        "tokens_per_s": round(metrics["tokens_per_s"] / time_scale, 2),
        "time_split_s": {k: round(v * time_scale, 3) for k, v in metrics["time_split_s"].items()},
        "completion_times_s": [round(t * time_scale, 4) for t in metrics["completion_times_s"]],
    }


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    if not steps:
        return {}
    makespan = sum(s["makespan_s"] for s in steps)
    return {
        "steps": len(steps),
        "total_makespan_s": round(makespan, 4),
        "mean_makespan_s": round(makespan / len(steps), 4),
        "completed": sum(s["completed"] for s in steps),
        "failed": sum(s["failed"] for s in steps),
        "trajectories_per_s": round(sum(s["completed"] for s in steps) / makespan, 4)
        if makespan
        else 0.0,
        "tokens_per_s": round(sum(s["generated_tokens"] for s in steps) / makespan, 2)
        if makespan
        else 0.0,
        # over the run's time, as "N trajectories in T modelled s; engine busy X%" reads: a
        # plain mean over steps weighed a short last step as much as a long first one
        "engine_busy_fraction": round(time_weighted(steps, "engine_busy_fraction"), 4),
        "mean_batch_occupancy": round(time_weighted(steps, "mean_batch_occupancy"), 4),
        "tool_timeouts": sum(s["tool_timeouts"] for s in steps),
        "tool_errors": sum(s["tool_errors"] for s in steps),
        "tool_calls_abandoned": sum(s["tool_calls_abandoned"] for s in steps),
        "aborted": sum(s["aborted"] for s in steps),
        "wasted_tokens": sum(s["wasted_tokens"] for s in steps),
    }


def time_weighted(steps: list[dict[str, Any]], key: str) -> float:
    """A per-step mean over the steps' whole time (each step weighed by its makespan), as
    "engine busy X% over T modelled s" reads: a plain mean over steps weighed a short last step
    as much as a long first one. The run summary and the study's cells both use it."""
    values = [s[key] for s in steps]
    weights = [s["makespan_s"] for s in steps]
    if not sum(weights):
        return float(np.mean(values))
    return float(np.average(values, weights=weights))
