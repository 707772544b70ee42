"""Does the engine model predict a real engine? The same workload on both, policy by policy.

`toolenv rollout calibrate --check TRACE` fits the cost model from the real engine (a
microbenchmark of prefill and decode, then refined by replaying a calibration workload recorded on
the engine, as `validate` fits PolyTrace's timings), then runs a different small replay (e.g. 64 scaled search_r1 trajectories) on that engine in real time and on the
event-driven model in virtual time, under sync, async and async+overlap, and reports

    accuracy = 1 - |simulated - real| / real

for the step makespan and the mean turn latency (submit to last token). Tools are the
in-process `SimTools` in both runs (recorded latencies, scaled): the check isolates the engine
model; the gateway and the emulators are tested on their own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from toolenv_core.polytrace import TrajectoryRecord

from .calibrate import CalibrationPlan, measure, profile_from
from .clock import run_virtual
from .engines.base import Engine
from .engines.costmodel import CostModel
from .engines.eventsim import EventSimEngine
from .session import run_rollout
from .settings import RolloutSettings
from .simtools import SimTools, ToolModel
from .validate import fit_cost_model, validate_step
from .workloads.plan import TrajectoryPlan

CHECK_POLICIES = ("sync", "async", "async+overlap")


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


async def real_runs(
    engine: Engine, plans: list[TrajectoryPlan], batch: int, tool_scale: float
) -> dict[str, dict[str, float]]:
    """Each policy on the started real engine, in real time (the engine stays up throughout)."""
    out = {}
    for policy in CHECK_POLICIES:
        tools = SimTools({}, default=ToolModel(scale=tool_scale))
        report = await run_rollout(
            _settings(policy, batch, "wall"),
            iter(_relabel(plans, policy)),
            engine=engine,
            tools=tools,
        )
        out[policy] = figures(report)
    return out


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


def compare(
    real: dict[str, dict[str, float]], simulated: dict[str, dict[str, float]]
) -> list[dict[str, Any]]:
    rows = []
    for policy in CHECK_POLICIES:
        r, s = real[policy], simulated[policy]
        rows.append(
            {
                "policy": policy,
                "makespan_real_s": r["makespan_s"],
                "makespan_sim_s": s["makespan_s"],
                "makespan_accuracy": accuracy(r["makespan_s"], s["makespan_s"]),
                "turn_latency_real_s": r["mean_turn_latency_s"],
                "turn_latency_sim_s": s["mean_turn_latency_s"],
                "turn_latency_accuracy": accuracy(
                    r["mean_turn_latency_s"], s["mean_turn_latency_s"]
                ),
                "completed": [r["completed"], s["completed"]],
            }
        )
    return rows


async def record_workload(
    engine: Engine, plans: list[TrajectoryPlan], tool_scale: float
) -> list[TrajectoryRecord]:
    """The calibration workload on the real engine: all launched at once, async; its records."""
    tools = SimTools({}, default=ToolModel(scale=tool_scale))
    launched = _relabel(plans, "calibration")
    report = await run_rollout(
        _settings("async", len(plans), "wall"), iter(launched), engine=engine, tools=tools,
    )  # fmt: skip
    # Records come in completion order; a replay must launch them in the order they were launched
    # (with fewer slots than requests, the order decides who queues).
    order = {p.trajectory_id: i for i, p in enumerate(launched)}
    return sorted(report["_records"], key=lambda r: order[r.trajectory_id])


async def calibrate_and_run(
    engine: Engine,
    plan: CalibrationPlan,
    *,
    name: str,
    vocab_size: int,
    plans: list[TrajectoryPlan],
    calibration: list[TrajectoryPlan],
    batch: int,
    tool_scale: float,
) -> tuple[CostModel, list[TrajectoryRecord], dict[str, dict[str, float]]]:
    """Start the real engine once: microbenchmark it, record the calibration workload on it,
    then run the check workload under each policy."""
    await engine.start()
    try:
        samples = await measure(engine, plan, vocab_size)
        first = profile_from(engine, plan, samples, name)
        recorded = await record_workload(engine, calibration, tool_scale)
        return first, recorded, await real_runs(engine, plans, batch, tool_scale)
    finally:
        await engine.close()


REPLAY_FIT_FIELDS = (
    "decode_base_s",
    "decode_per_seq_s",
    "prefill_per_token_s",
    "request_latency_s",
)


def check_loss(result: dict[str, Any]) -> float:
    """A small workload: makespan, the completion-time distance and the mean turn latency."""
    rec, sim = result["turn_latency_mean_recorded_s"], result["turn_latency_mean_simulated_s"]
    turn = abs(sim - rec) / max(rec, 1e-9)
    return (1 - result["makespan_accuracy"]) + result["completion_w1_rel"] + turn


def fit_on_records(first: CostModel, recorded: list[TrajectoryRecord]) -> CostModel:
    """Refine the microbenchmark fit by replaying the recorded calibration workload (validate's
    fit, batch limit known), and keep both fit errors."""
    cost, loss = fit_cost_model(
        [recorded], first, fields=REPLAY_FIT_FIELDS, max_evaluations=150, loss_fn=check_loss
    )
    replay = validate_step(recorded, cost)
    return cost.model_copy(
        update={
            "fit_error": {
                **(first.fit_error or {}),
                "replay_fit_loss": round(loss, 4),
                "replay_makespan_accuracy": replay["makespan_accuracy"],
                "replay_completion_ks": replay["completion_ks"],
            }
        }
    )
