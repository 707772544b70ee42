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
from scipy import optimize

from .calibrate import CalibrationPlan, measure, profile_from
from .clock import run_virtual
from .engines.base import Engine
from .engines.costmodel import CostModel
from .engines.eventsim import EventSimEngine
from .itertimes import StreamLog, fit_iterations, iterations
from .session import run_rollout
from .settings import RolloutSettings
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
) -> tuple[Runs, Runs, np.ndarray]:
    """Both workloads under every policy, `rounds` times, interleaved (calibration, check, next
    policy), after one discarded warm-up run: load on the machine and the engine's warm-up drift
    then fall on both alike, and the medians shed a stalled run. Also returns the iterations of
    the calibration runs (`itertimes.iterations`)."""
    await run_real(engine, calibration, "async", batch, tool_scale, "warmup")
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
    return fitted, checked, np.vstack(rows)


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
    rounds: int = 3,
) -> tuple[CostModel, Runs, Runs]:
    """Start the real engine once: microbenchmark it, run the calibration and the check workloads
    under each policy, `rounds` times interleaved (see `real_rounds`), and fit the cost model to
    the calibration runs' iterations. Returns that fit (start of `fit_on_policies`) and the runs."""
    logged = StreamLog(engine)
    await engine.start()
    try:
        samples = await measure(engine, plan, vocab_size)
        first = profile_from(engine, plan, samples, name)
        fitted, checked, rows = await real_rounds(
            logged, plans, calibration, batch, tool_scale, rounds
        )
    finally:
        await engine.close()
    return fit_iterations(rows, first), fitted, checked


# Every coefficient a replay can tell apart: the per-sequence and per-context terms trade off
# against the fixed one between a full batch (sync) and a draining tail (async).
REPLAY_FIT_FIELDS = (
    "decode_base_s",
    "decode_per_seq_s",
    "decode_per_ctx_token_s",
    "prefill_per_token_s",
    "prefill_per_seq_s",
    "request_latency_s",
)


def policy_loss(real: dict[str, dict[str, float]], sim: dict[str, dict[str, float]]) -> float:
    """Mean over the policies of the makespan and mean-turn-latency relative errors."""
    errors = [
        abs(sim[p][k] - real[p][k]) / max(real[p][k], 1e-9)
        for p in CHECK_POLICIES
        for k in ("makespan_s", "mean_turn_latency_s")
    ]
    return float(np.mean(errors))


def fit_on_policies(
    first: CostModel,
    calibration: list[TrajectoryPlan],
    real: Runs,
    batch: int,
    tool_scale: float,
    max_evaluations: int = 300,
) -> CostModel:
    """Refine the microbenchmark's coefficients so the model replays the calibration workload
    as the engine ran it under every policy (Nelder-Mead over their logarithms, started from the
    microbenchmark fit; a few seconds, each trial is three virtual-time replays)."""
    target = median_figures(real)
    start = first.model_copy(update={"request_latency_s": max(first.request_latency_s, 1e-3)})
    x0 = np.log([max(float(getattr(start, f)), 1e-9) for f in REPLAY_FIT_FIELDS])

    def model(x: np.ndarray) -> CostModel:
        return start.model_copy(
            update=dict(zip(REPLAY_FIT_FIELDS, np.exp(x).tolist(), strict=True))
        )

    def loss(x: np.ndarray) -> float:
        return policy_loss(target, simulated_runs(model(x), calibration, batch, tool_scale))

    result = optimize.minimize(
        loss,
        x0,
        method="Nelder-Mead",
        options={"maxfev": max_evaluations, "xatol": 0.01, "fatol": 1e-4},
    )
    cost = model(result.x)
    replay = compare(real, simulated_runs(cost, calibration, batch, tool_scale))
    return cost.model_copy(
        update={
            "fit_error": {
                **(first.fit_error or {}),
                "replay_fit_loss": round(float(result.fun), 4),
                **{
                    f"replay_{row['policy']}_{key}": row[key]
                    for row in replay
                    for key in ("makespan_accuracy", "turn_latency_accuracy")
                },
            }
        }
    )
