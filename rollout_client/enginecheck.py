"""Does the engine model predict a real engine? The same workload on both, policy by policy.

`toolenv rollout calibrate --check TRACE` runs two disjoint sets of scaled search_r1
trajectories on the real engine under sync, async and async+overlap, `CHECK_ROUNDS` times,
interleaved: the calibration set, whose iterations (read off the token stream, `itertimes`) the cost model is
fitted on, and the check set, which the fitted model then replays in virtual time. It reports

    accuracy = 1 - |simulated - real| / real

for the step makespan and the mean turn latency (submit to last token), against the median of
the real runs and against each one (the run-to-run spread of a shared 2-core machine). Tools are the
in-process `SimTools` in both runs (recorded latencies, scaled): the check isolates the engine
model; the gateway and the emulators are tested on their own.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np

from .calibrate import CalibrationPlan, measure, profile_from
from .clock import run_virtual
from .engines.base import Engine
from .engines.costmodel import CostModel
from .engines.eventsim import EventSimEngine
from .itertimes import StreamLog, fit_iterations, iterations
from .session import run_rollout
from .settings import CHECK_ROUNDS, RolloutSettings
from .simtools import SimTools, ToolModel
from .workloads.plan import TrajectoryPlan

CHECK_POLICIES = ("sync", "async", "async+overlap")
Runs = dict[str, list[dict[str, float]]]  # policy -> figures of each real run


def _settings(policy: str, batch: int, clock: str) -> RolloutSettings:
    return RolloutSettings(
        engine="sim" if clock == "virtual" else "vllm",
        clock=clock,  # type: ignore[arg-type]
        policy=policy,
        batch=batch,
        exact=True,
        overlap_ratio=0.25,
    )


def _relabel(plans: list[TrajectoryPlan], policy: str) -> list[TrajectoryPlan]:
    """Fresh trajectory ids (hence fresh prompts) per policy: no run warms another's cache."""
    tag = policy.replace("+", "_")
    return [dataclasses.replace(p, trajectory_id=f"{tag}-{p.trajectory_id}") for p in plans]


def figures(report: dict[str, Any]) -> dict[str, float]:
    step = report["steps"][0]
    turns = [t.engine_latency_s for r in report["_records"] for t in r.turns]
    return {
        "makespan_s": round(step["makespan_s"], 4),
        "mean_turn_latency_s": round(float(np.mean(turns)), 4) if turns else 0.0,
        "completed": step["completed"],
    }


async def run_real(
    engine: Engine,
    plans: list[TrajectoryPlan],
    policy: str,
    batch: int,
    tool_scale: float,
    tag: str,
) -> dict[str, float]:
    """One policy on the started real engine, in real time; fresh ids (prompts) per `tag`."""
    tools = SimTools({}, default=ToolModel(scale=tool_scale))
    report = await run_rollout(
        _settings(policy, batch, "wall"), iter(_relabel(plans, tag)), engine=engine, tools=tools
    )
    return figures(report)


async def real_rounds(
    engine: StreamLog,
    check: list[TrajectoryPlan],
    calibration: list[TrajectoryPlan],
    batch: int,
    tool_scale: float,
    rounds: int,
) -> tuple[Runs, Runs, list[np.ndarray]]:
    """Both workloads under every policy, `rounds` times, interleaved (calibration, check, next
    policy), after one discarded warm-up round of the same runs: load on the machine then falls
    on both alike, the medians shed a stalled run, and no measured run pays the engine's
    first batches of each policy's shapes (a single warm-up run left the first measured round
    the slowest in 53% of the series). Also returns the iterations of each calibration run
    (`itertimes.iterations`)."""
    for policy in CHECK_POLICIES:
        tag = f"warmup-{policy.replace('+', '_')}"
        await run_real(engine, calibration, policy, batch, tool_scale, "cal-" + tag)
        await run_real(engine, check, policy, batch, tool_scale, tag)
    fitted: Runs = {p: [] for p in CHECK_POLICIES}
    checked: Runs = {p: [] for p in CHECK_POLICIES}
    rows = []
    for r in range(rounds):
        for policy in CHECK_POLICIES:
            tag = f"{policy.replace('+', '_')}-{r}"
            engine.requests.clear()
            fitted[policy].append(
                await run_real(engine, calibration, policy, batch, tool_scale, "cal-" + tag)
            )
            rows.append(iterations(engine.requests))
            checked[policy].append(await run_real(engine, check, policy, batch, tool_scale, tag))
    engine.requests.clear()
    return fitted, checked, rows


def median_figures(runs: Runs) -> dict[str, dict[str, float]]:
    return {
        policy: {
            "makespan_s": float(np.median([f["makespan_s"] for f in rs])),
            "mean_turn_latency_s": float(np.median([f["mean_turn_latency_s"] for f in rs])),
            "completed": min(f["completed"] for f in rs),
        }
        for policy, rs in runs.items()
    }


def simulated_runs(
    cost: CostModel, plans: list[TrajectoryPlan], batch: int, tool_scale: float
) -> dict[str, dict[str, float]]:
    out = {}
    for policy in CHECK_POLICIES:
        tools = SimTools({}, default=ToolModel(scale=tool_scale))
        report = run_virtual(
            run_rollout(
                _settings(policy, batch, "virtual"),
                iter(_relabel(plans, policy)),
                engine=EventSimEngine(cost),
                tools=tools,
            )
        )
        out[policy] = figures(report)
    return out


def accuracy(real: float, simulated: float) -> float:
    return round(1 - abs(simulated - real) / real, 4) if real > 0 else 0.0


def compare(real: Runs, simulated: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Per policy: the model against the median real run, and against each real run."""
    rows = []
    for policy, (r, s) in zip(
        CHECK_POLICIES,
        ((median_figures(real)[p], simulated[p]) for p in CHECK_POLICIES),
        strict=True,
    ):
        runs = real[policy]
        rows.append(
            {
                "policy": policy,
                "makespan_real_s": round(r["makespan_s"], 4),
                "makespan_sim_s": s["makespan_s"],
                "makespan_accuracy": accuracy(r["makespan_s"], s["makespan_s"]),
                "turn_latency_real_s": round(r["mean_turn_latency_s"], 4),
                "turn_latency_sim_s": s["mean_turn_latency_s"],
                "turn_latency_accuracy": accuracy(
                    r["mean_turn_latency_s"], s["mean_turn_latency_s"]
                ),
                "completed": [r["completed"], s["completed"]],
                "makespan_real_runs_s": [f["makespan_s"] for f in runs],
                "turn_latency_real_runs_s": [f["mean_turn_latency_s"] for f in runs],
                "makespan_accuracy_per_run": [
                    accuracy(f["makespan_s"], s["makespan_s"]) for f in runs
                ],
                "turn_latency_accuracy_per_run": [
                    accuracy(f["mean_turn_latency_s"], s["mean_turn_latency_s"]) for f in runs
                ],
            }
        )
    return rows


async def measure_and_run(
    engine: Engine,
    plan: CalibrationPlan,
    *,
    name: str,
    vocab_size: int,
    plans: list[TrajectoryPlan],
    calibration: list[TrajectoryPlan],
    batch: int,
    tool_scale: float,
    rounds: int = CHECK_ROUNDS,
) -> tuple[CostModel, Runs, Runs]:
    """On a started engine: microbenchmark it (isolated batches: a first profile, and a warm-up),
    run the calibration and the check workloads under each policy (`real_rounds`), and fit the
    cost model to the iterations of the calibration runs. Returns that profile, with how well it
    replays the calibration runs in its fit error, and the real runs of both workloads."""
    samples = await measure(engine, plan, vocab_size)
    first = profile_from(engine, plan, samples, name)
    fitted, checked, rows = await real_rounds(
        StreamLog(engine), plans, calibration, batch, tool_scale, rounds
    )
    cost = fit_iterations(rows, first).model_copy(
        update={
            "source": f"toolenv rollout calibrate --engine {engine.name} --check: "
            f"{sum(len(r) for r in rows)} iterations of {rounds} x {len(CHECK_POLICIES)} calibration runs "
            f"({len(calibration)} trajectories; microbenchmark: {len(samples)} requests)"
        }
    )
    # Virtual time runs its own loop: in a thread, off the one the real engine runs on.
    sim = await asyncio.to_thread(simulated_runs, cost, calibration, batch, tool_scale)
    replay = compare(fitted, sim)
    errors = {
        f"calibration_{row['policy']}_{key}": row[key]
        for row in replay
        for key in ("makespan_accuracy", "turn_latency_accuracy")
    }
    return (
        cost.model_copy(update={"fit_error": {**(cost.fit_error or {}), **errors}}),
        fitted,
        checked,
    )
