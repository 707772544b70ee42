"""`toolenv rollout study`: every straggler policy against every tool scenario, in virtual time.

A cell is one policy under one tool scenario: full rollout steps of the recorded Search-R1
trajectories (their turn structure, lengths and tool calls) through the same runner, policies and
metrics as a live run, on the virtual clock with the event-driven engine and in-process tools.
Every cell replays the same trajectories with the same per-call random draws, so cells differ
by policy and scenario only.

Scenarios (the tool's latency, everything else as recorded):
- `recorded`: each call's recorded latency (the dense retriever Search-R1 called);
- `x10`, `x100`: the same, ten and a hundred times slower (slower real tools: web search, code
  execution, an LLM judge);
- `hangs`: recorded, plus 1% of calls that never answer (until the deadline, else `hang_s`);
- `reward`: code verification: each call takes the time rllm_deepcoder's sandbox took per
  response (a recorded batch's `reward_time_s` / its batch size, the reward emulator's linear
  rule), drawn from the recorded batches.

Deadlines at a quantile use the scenario's own latency distribution (the recorded calls of the
steps studied, scaled), as an operator would set them from a latency histogram. A hedge's second
attempt draws a fresh latency from that distribution (a recorded latency belongs to one attempt).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from toolenv_core.console import counted
from toolenv_core.hedging import LatencyWindow
from toolenv_core.latency import HangFault
from toolenv_core.latency.samplers import InterpolatedSampler
from toolenv_core.polytrace.kinds import files_of_kind
from toolenv_core.polytrace.rewards import read_reward_timings
from toolenv_core.sigterm import sigterm_cancels

from .clock import run_virtual
from .engines.costmodel import CostModel, load_cost_model
from .engines.eventsim import EventSimEngine
from .metrics import time_weighted
from .policies import OverlapPolicy
from .session import run_rollout
from .settings import RolloutSettings
from .simtools import SimTools, ToolModel
from .workloads.plan import TrajectoryPlan
from .workloads.replay import replay_plans

HANG_S = 60.0  # a hang without a deadline lasts as long as the emulators' default


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    scale: float = 1.0
    hang_rate: float = 0.0
    reward: bool = False


SCENARIOS = [
    Scenario("recorded", "recorded search latency"),
    Scenario("x10", "search latency x10", scale=10.0),
    Scenario("x100", "search latency x100", scale=100.0),
    Scenario("hangs", "recorded + 1% hangs", hang_rate=0.01),
    Scenario("reward", "code-verification latency (rllm_deepcoder)", reward=True),
]


@dataclass(frozen=True)
class PolicyCell:
    """One policy of the matrix: a spec for `build_policy` and how its knobs are set."""

    label: str
    spec: str
    timeout: str | None = None  # "2s" (fixed) or "p99" (a quantile of the scenario's latency)
    hedge_q: float | None = None
    over: float | None = None
    unfinished: str = "carry"


FULL_POLICIES = [
    PolicyCell("sync", "sync"),
    PolicyCell("async", "async"),
    PolicyCell("timeout 2s", "async+timeout", timeout="2s"),
    PolicyCell("timeout p95", "async+timeout", timeout="p95"),
    PolicyCell("timeout p99", "async+timeout", timeout="p99"),
    PolicyCell("hedge p95", "async+hedge", hedge_q=0.95),
    PolicyCell("overlap 10% carry", "async+overlap", over=0.1),
    PolicyCell("overlap 25% carry", "async+overlap", over=0.25),
    PolicyCell("overlap 50% carry", "async+overlap", over=0.5),
    PolicyCell("overlap 25% abort", "async+overlap", over=0.25, unfinished="abort"),
    PolicyCell("overlap 50% abort", "async+overlap", over=0.5, unfinished="abort"),
    PolicyCell("timeout p99 + overlap 25%", "async+timeout+overlap", timeout="p99", over=0.25),
    PolicyCell("hedge p95 + overlap 25%", "async+hedge+overlap", hedge_q=0.95, over=0.25),
    PolicyCell(
        "timeout p99 + hedge p95 + overlap 50%",
        "async+timeout+hedge+overlap",
        timeout="p99",
        hedge_q=0.95,
        over=0.5,
    ),
]
QUICK_POLICIES = [
    p
    for p in FULL_POLICIES
    if p.label
    in {
        "sync",
        "async",
        "timeout p99",
        "hedge p95",
        "overlap 25% carry",
        "overlap 25% abort",
        "timeout p99 + hedge p95 + overlap 50%",
    }
]


@dataclass
class StudyPlan:
    traces: list[Path]
    reward_traces: list[Path]
    batch: int = 2048
    steps: int = 2
    seed: int = 0
    cost_profile: str = "searchr1-qwen7b"
    scenarios: list[Scenario] = field(default_factory=lambda: list(SCENARIOS))
    policies: list[PolicyCell] = field(default_factory=lambda: list(FULL_POLICIES))

    @classmethod
    def quick(cls, traces: list[Path], reward_traces: list[Path], seed: int = 0) -> StudyPlan:
        return cls(traces, reward_traces, batch=256, steps=2, seed=seed, policies=QUICK_POLICIES)


def _quantile_sampler(values: np.ndarray) -> InterpolatedSampler:
    probabilities = np.linspace(0.0, 1.0, 1001)
    return InterpolatedSampler(probabilities, np.quantile(values, probabilities))


def reward_latencies(paths: Iterable[Path]) -> np.ndarray:
    """Seconds per verified response: each recorded batch's time over its batch size."""
    files = files_of_kind(paths, "reward_timings")  # rllm_deepcoder as a directory works too
    values = [r.reward_time_s / r.batch_size for p in files for r in read_reward_timings(p)]
    if not values:
        raise ValueError("no reward timings in --reward-trace (rllm_deepcoder/reward_timings_*)")
    return np.asarray(values, dtype=float)


class ScenarioTools:
    """Builds the in-process tools and the latency quantiles of one scenario."""

    def __init__(self, scenario: Scenario, recorded: np.ndarray, reward: np.ndarray | None) -> None:
        self.scenario = scenario
        if scenario.reward:
            if reward is None:
                raise ValueError("the reward scenario needs --reward-trace")
            self.latencies = reward
        else:
            self.latencies = recorded * scenario.scale
        self._sampler = _quantile_sampler(reward if scenario.reward else recorded)

    def quantile(self, q: float) -> float:
        return float(np.quantile(self.latencies, q))

    def build(self, seed: int, hedge_q: float | None) -> SimTools:
        s = self.scenario
        faults = [HangFault(rate=s.hang_rate)] if s.hang_rate else []
        model = ToolModel(
            sampler=self._sampler, scale=1.0 if s.reward else s.scale, faults=faults,
            use_recorded=not s.reward,
        )  # fmt: skip
        hedge: Callable[[], LatencyWindow] | None = None
        if hedge_q is not None:
            q = hedge_q

            def hedge() -> LatencyWindow:
                return LatencyWindow(q)

        return SimTools({}, default=model, seed=seed, hedge=hedge, hang_s=HANG_S)


def cell_settings(plan: StudyPlan, cell: PolicyCell, tools: ScenarioTools) -> RolloutSettings:
    timeout = 1.0
    if cell.timeout is not None:
        if cell.timeout.endswith("s"):
            timeout = float(cell.timeout[:-1])
        else:
            timeout = tools.quantile(float(cell.timeout[1:]) / 100)
    return RolloutSettings(
        engine="sim",
        clock="virtual",
        cost_profile=plan.cost_profile,
        policy=cell.spec,
        tool_timeout_s=timeout,
        overlap_ratio=cell.over or 0.25,
        overlap_unfinished=cell.unfinished,  # type: ignore[arg-type]
        hedge_quantile=cell.hedge_q or 0.95,
        batch=plan.batch,
        steps=plan.steps,
        exact=True,
        seed=plan.seed,
    )


async def _rollout(
    settings: RolloutSettings, plans: list[TrajectoryPlan], tools: SimTools, cost: CostModel
) -> dict[str, Any]:
    """The cell's rollout on an engine of the cost model the driver loaded: a Ray worker read
    `--cost-profile FILE` again, relative to its own directory, on its own node."""
    engine = EventSimEngine(cost)
    await engine.start()
    try:
        return await run_rollout(settings, iter(plans), engine=engine, tools=tools)
    finally:
        await engine.close()


def run_cell(
    plan: StudyPlan,
    cell: PolicyCell,
    tools: ScenarioTools,
    plans: list[TrajectoryPlan],
    cost: CostModel,
    *,
    here: bool = False,
) -> dict[str, Any]:
    """One cell's row. `here`: in the command's own process, where SIGTERM cancels the cell as
    Ctrl-C does (raised where the main thread stood, it landed in one trajectory's task, which
    kept it as that trajectory's error, and the study went on); a Ray worker leaves it to Ray."""
    settings = cell_settings(plan, cell, tools)
    sim_tools = tools.build(plan.seed, cell.hedge_q)
    rollout = _rollout(settings, plans, sim_tools, cost)
    report = run_virtual(sigterm_cancels(rollout) if here else rollout)
    steps = report["steps"]
    timelines = report.pop("_timelines")
    calls = sum(s["tool_calls"] for s in steps)
    cut = sum(s["tool_timeouts"] for s in steps)
    abandoned = sum(s["tool_calls_abandoned"] for s in steps)
    completed = [s for s in steps if s["completed"]]
    makespan = float(np.mean([s["makespan_s"] for s in steps]))
    return {
        "scenario": tools.scenario.name,
        "policy": cell.label,
        "spec": report["policy"],
        "tool_timeout_s": round(settings.tool_timeout_s, 3) if cell.timeout else None,
        "makespan_s": round(makespan, 2),
        "trajectories_per_s": _rate(sum(s["completed"] for s in steps) / sum(s["makespan_s"] for s in steps)),
        # over the cell's time, as the run summary weighs them (`time_weighted`)
        "mean_batch_occupancy": round(time_weighted(steps, "mean_batch_occupancy"), 4),
        "mean_in_flight": round(time_weighted(steps, "mean_in_flight"), 1),
        "capacity": report["engine_capacity"],
        "tail_share": round(float(np.mean([s["tail_share"] for s in completed])), 4) if completed else None,
        "tool_calls": calls,
        "calls_cut": cut,
        "calls_cut_share": round(cut / calls, 4) if calls else 0.0,
        "calls_abandoned": abandoned,
        "duplicate_calls": report["tools"]["hedges"],
        "mean_staleness": round(steady_staleness(steps), 3),
        "carried_at_end": steps[-1]["carried"] if steps else 0,
        "wasted_tokens": sum(s["wasted_tokens"] for s in steps),
        "generated_tokens": sum(s["generated_tokens"] for s in steps),
        "wall_s": report["wall"]["elapsed_s"],
        # a failed trajectory is no figure of the policy: the report and the CLI say so
        "failed": sum(s["failed"] for s in steps),
        "first_failure": next((f for s in steps for f in s["failures"]), None),
        "occupancy_timeline": _thin(timelines[0], report["engine_capacity"]) if timelines else [],
    }  # fmt: skip


def _rate(value: float) -> float:
    """A rate to 4 significant digits at least (3 decimals from 1 up): at 3 decimals a slow cell's
    0.0006 trajectories/s read 0.001 or 0.0, and the speed-ups taken from it read 1.00x for a
    slower policy, or None, which the report could not print."""
    return round(value, max(3, 3 - math.floor(math.log10(value)))) if value > 0 else 0.0


def steady_staleness(steps: list[dict[str, Any]]) -> float:
    """Policy versions per completed trajectory, as a long run would see it: every trajectory
    carried across a step close (the last step's included) adds one version to a completion.

    The mean over the trajectories that finished within the run leaves out the last step's
    carried ones and the first step's lack of any: over two steps it reads half the steady value.
    """
    finished = sum(s["completed"] for s in steps)
    return sum(s["carried"] for s in steps) / finished if finished else 0.0


def _thin(points: list[tuple[float, int]], capacity: int, n: int = 200) -> list[list[float]]:
    """The first step's in-flight timeline as (seconds, in flight / capacity), at most ~n points."""
    if len(points) <= n:
        return [[round(t, 3), round(k / capacity, 4)] for t, k in points]
    keep = np.linspace(0, len(points) - 1, n).astype(int)
    return [[round(points[i][0], 3), round(points[i][1] / capacity, 4)] for i in keep]


def load_plans(plan: StudyPlan) -> tuple[list[TrajectoryPlan], np.ndarray]:
    """Every trajectory the cells may need (exact mode), and the recorded call latencies."""
    # An over-sampling cell that aborts launches N * (1 + ratio) fresh trajectories every step:
    # with fewer, its later steps ran short and were ranked beside cells that ran in full.
    launch = max(
        OverlapPolicy(over=p.over).launch_count(plan.batch) if p.over else plan.batch
        for p in plan.policies
    )
    need = launch * plan.steps
    want = max(need, int(plan.batch * plan.steps * 1.6) + plan.batch)
    traces = files_of_kind(plan.traces, "multiturn")  # directories, names in the trace cache
    plans = list(replay_plans(traces, exact=True, limit=want))
    if len(plans) < need:
        over = f", over-sampling launching {launch} a step" if launch > plan.batch else ""
        raise ValueError(
            f"the traces hold {counted(len(plans), 'trajectory')}; "
            f"{counted(plan.steps, 'step')} of {plan.batch} need "
            f"{need}{over} (give more --trace files or a smaller --batch/--steps)"
        )
    # The latency histogram of the trajectories every policy runs (the first steps x batch).
    base = plans[: plan.batch * plan.steps]
    recorded = np.asarray(
        [c.recorded_latency_s for p in base for t in p.turns for c in t.calls], dtype=float
    )
    if not recorded.size:  # the scenarios, deadlines and hedges are all of tool latency
        raise ValueError(
            f"the study runs {counted(len(base), 'trajectory')} and none makes a tool call: "
            "there is no tool latency to study (give a multi-turn trace with tool calls, such as "
            "search_r1)"
        )
    return plans, recorded


@dataclass(frozen=True)
class StudyInputs:
    """What every cell reads: loaded once, then shared (with Ray: put in the object store once)."""

    plan: StudyPlan
    plans: list[TrajectoryPlan]
    recorded: np.ndarray
    reward: np.ndarray | None
    cost: CostModel


CellJob = tuple[Scenario, PolicyCell]
# Runs the jobs (any order, anywhere), calls `on_done(index, row)` as each ends, returns the rows
# in job order. `run_here` runs them one after another in this process; `rollout_client.study_ray`
# spreads them over a Ray cluster.
JobRunner = Callable[
    [StudyInputs, list[CellJob], Callable[[int, dict[str, Any]], None]], list[dict[str, Any]]
]


def run_job(inputs: StudyInputs, job: CellJob, *, here: bool = False) -> dict[str, Any]:
    """One cell, from the shared inputs alone (deterministic: same inputs, same row); `here` as
    `run_cell` takes it."""
    scenario, cell = job
    tools = ScenarioTools(scenario, inputs.recorded, inputs.reward)
    return run_cell(inputs.plan, cell, tools, inputs.plans, inputs.cost, here=here)


def run_here(
    inputs: StudyInputs, jobs: list[CellJob], on_done: Callable[[int, dict[str, Any]], None]
) -> list[dict[str, Any]]:
    rows = []
    for i, job in enumerate(jobs):
        rows.append(run_job(inputs, job, here=True))
        on_done(i, rows[-1])
    return rows


def load_inputs(plan: StudyPlan) -> StudyInputs:
    """The traces read and checked: every input error is raised here, before any cell runs."""
    cost = load_cost_model(plan.cost_profile)
    plans, recorded = load_plans(plan)
    reward = reward_latencies(plan.reward_traces) if plan.reward_traces else None
    latencies = {"recorded tool calls": recorded}
    if reward is not None:
        latencies["reward timings"] = reward
    _check_quantile_deadlines(plan, latencies)
    return StudyInputs(plan, plans, recorded, reward, cost)


def _check_quantile_deadlines(plan: StudyPlan, latencies: dict[str, np.ndarray]) -> None:
    """A deadline at a quantile of latencies that are 0 s there would be 0 s: refused before any
    cell runs (it was `tool_timeout_s: Input should be greater than 0` after 30 cells)."""
    quantiles = {c.timeout for c in plan.policies if c.timeout and c.timeout.startswith("p")}
    for what, values in latencies.items():
        for q in sorted(quantiles):
            if np.quantile(values, float(q[1:]) / 100) <= 0:
                raise ValueError(
                    f"the {what} take 0 s at their {q}: the cells with a deadline there "
                    f"(timeout {q}) cannot set one; give timings whose {q} is above 0 s"
                )


def run_study(
    inputs: StudyInputs,
    on_cell: Callable[[dict[str, Any]], None] | None = None,
    runner: JobRunner = run_here,
) -> dict[str, Any]:
    plan = inputs.plan
    scenarios = [s for s in plan.scenarios if not s.reward or inputs.reward is not None]
    jobs = [(scenario, cell) for scenario in scenarios for cell in plan.policies]
    base: dict[str, float] = {}  # scenario -> the sync cell's trajectories/s

    def speedup(row: dict[str, Any]) -> float | None:
        sync = base.get(row["scenario"])
        return round(row["trajectories_per_s"] / sync, 3) if sync else None

    def on_done(i: int, row: dict[str, Any]) -> None:
        if jobs[i][1].spec == "sync":
            base[row["scenario"]] = row["trajectories_per_s"]
        row["speedup_over_sync"] = speedup(row)  # None while its scenario's sync is running
        if on_cell is not None:
            on_cell(row)

    cells = runner(inputs, jobs, on_done)
    for row in cells:
        row["speedup_over_sync"] = speedup(row)
    return {
        "study": {
            "traces": [str(p) for p in plan.traces],
            "reward_traces": [str(p) for p in plan.reward_traces],
            "batch": plan.batch,
            "steps": plan.steps,
            "seed": plan.seed,
            "cost_profile": plan.cost_profile,
            "scenarios": {s.name: s.title for s in scenarios},
            "skipped": [s.name for s in plan.scenarios if s not in scenarios],
        },
        "cells": cells,
        "recommendations": recommend(cells),
    }


def recommend(cells: list[dict[str, Any]], max_cut: float = 0.01) -> dict[str, dict[str, Any]]:
    """Per scenario: the fastest policy that cuts at most `max_cut` of the calls."""
    out: dict[str, dict[str, Any]] = {}
    for scenario in dict.fromkeys(c["scenario"] for c in cells):
        rows = [c for c in cells if c["scenario"] == scenario]
        ok = [c for c in rows if c["calls_cut_share"] <= max_cut]
        best = max(ok or rows, key=lambda c: c["speedup_over_sync"] or 0.0)
        out[scenario] = {
            "policy": best["policy"],
            "speedup_over_sync": best["speedup_over_sync"],
            "calls_cut_share": best["calls_cut_share"],
            "calls_abandoned": best["calls_abandoned"],
            "mean_staleness": best["mean_staleness"],
            "wasted_tokens": best["wasted_tokens"],
            "within_cut_budget": bool(ok),
        }
    return out
