"""`toolenv rollout validate`: replay a recorded step in virtual time and compare with its timings.

PolyTrace's search_r1 traces were produced by verl's SGLang multi-turn rollout, which runs every
request of a step as its own coroutine (`asyncio.gather` over the requests: generate a turn,
call the tool, append, generate the next) against one engine that batches whatever is in
flight: trajectory-level asynchrony, all of the step launched at once, the step closing when the
last trajectory ends. That is this client's `async` policy with the whole step as the batch.
The recording gives, per turn, `engine_latency_s` (submit to last token, queueing included) and,
per call, `latency_s`; a trajectory's completion time is their sum, and the step's makespan is
the slowest trajectory's. The replay runs the same trajectories (lengths forced, each call's
recorded latency) on the engine model and compares:

- makespan accuracy = 1 - |simulated - recorded| / recorded;
- the two-sample KS distance between the per-trajectory completion times;
- per-turn engine latency p50 and p90, simulated against recorded.

`fit_cost_model` searches the engine model's decode and prefill coefficients for the best match
on some steps, so the figures can be reported on a step the fit never saw.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import scipy

from toolenv_core.plotting import pyplot
from toolenv_core.polytrace import TraceFormatError, TrajectoryRecord, read_multiturn
from toolenv_core.polytrace.jsonl import line_of_record

from .clock import run_virtual
from .engines.costmodel import CostModel
from .engines.eventsim import EventSimEngine
from .session import run_rollout
from .settings import RolloutSettings
from .workloads.replay import plan_from_record

COMPLETION_DECIMALS = 4  # the report's `completion_times_s` resolution (rollout_client.metrics)


def recorded_timings(records: list[TrajectoryRecord]) -> tuple[np.ndarray, np.ndarray]:
    """Per trajectory: summed engine and tool time; per turn: engine latency."""
    completion = np.asarray(
        [
            sum(t.engine_latency_s or 0.0 for t in r.turns)
            + sum(c.latency_s or 0.0 for c in r.tool_calls)
            for r in records
        ]
    )
    turns = np.asarray([t.engine_latency_s or 0.0 for r in records for t in r.turns])
    return completion, turns


def simulate(records: list[TrajectoryRecord], cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """The same step under verl's policy (async, all at once) in virtual time."""
    plans = [plan_from_record(r, i, exact=True) for i, r in enumerate(records)]
    settings = RolloutSettings(
        engine="sim", clock="virtual", policy="async", batch=len(plans), exact=True
    )
    report = run_virtual(run_rollout(settings, iter(plans), engine=EventSimEngine(cost)))
    completion = np.asarray(report["steps"][0]["completion_times_s"])
    turns = np.asarray([t.engine_latency_s for r in report["_records"] for t in r.turns])
    return completion, turns


def compare(
    recorded: tuple[np.ndarray, np.ndarray], simulated: tuple[np.ndarray, np.ndarray]
) -> dict[str, Any]:
    rec_done, rec_turns = recorded
    sim_done, sim_turns = simulated
    # The simulated completion times come from the report, at 0.1 ms: the recorded ones at full
    # precision differed from equal ones by microseconds, which KS counts as whole steps (1/n).
    rec_done, sim_done = (
        np.round(rec_done, COMPLETION_DECIMALS),
        np.round(sim_done, COMPLETION_DECIMALS),
    )
    rec_makespan, sim_makespan = float(rec_done.max()), float(sim_done.max())
    return {
        "trajectories": len(rec_done),
        "turns": len(rec_turns),
        "makespan_recorded_s": round(rec_makespan, 2),
        "makespan_simulated_s": round(sim_makespan, 2),
        "makespan_accuracy": round(1 - abs(sim_makespan - rec_makespan) / rec_makespan, 4),
        "completion_ks": round(float(scipy.stats.ks_2samp(rec_done, sim_done).statistic), 4),
        # the mean distance between the two sorted samples, over the recorded mean (Wasserstein-1):
        # smoother than KS for small steps
        "completion_w1_rel": round(
            float(
                scipy.stats.wasserstein_distance(rec_done, sim_done) / max(rec_done.mean(), 1e-9)
            ),
            4,
        ),
        "turn_latency_mean_recorded_s": round(float(rec_turns.mean()), 4),
        "turn_latency_mean_simulated_s": round(float(sim_turns.mean()), 4),
        "completion_mean_recorded_s": round(float(rec_done.mean()), 2),
        "completion_mean_simulated_s": round(float(sim_done.mean()), 2),
        "turn_latency_recorded_s": _quantiles(rec_turns),
        "turn_latency_simulated_s": _quantiles(sim_turns),
    }


def _quantiles(values: np.ndarray) -> dict[str, float]:
    return {f"p{q}": round(float(np.percentile(values, q)), 2) for q in (50, 90, 99)}


def validate_step(records: list[TrajectoryRecord], cost: CostModel) -> dict[str, Any]:
    return compare(recorded_timings(records), simulate(records, cost))


def plot_step(
    records: list[TrajectoryRecord], cost: CostModel, path: Path, title: str
) -> dict[str, Any]:
    """`validate_step`, plus a PNG: completion-time and turn-latency CDFs, recorded and simulated."""
    plt = pyplot()

    recorded, simulated = recorded_timings(records), simulate(records, cost)
    result = compare(recorded, simulated)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    panels = [("trajectory completion time (s)", 0), ("engine latency per turn (s)", 1)]
    for ax, (label, k) in zip(axes, panels, strict=True):
        for name, arrays, style in (("recorded", recorded, "-"), ("simulated", simulated, "--")):
            # a step CDF from 0: a line through the points drew nothing for one trajectory (one
            # point) and sloped between the others
            ax.ecdf(arrays[k], linestyle=style, label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("fraction")
        ax.legend(fontsize=8)
    axes[0].set_title(
        f"makespan {result['makespan_simulated_s']:.0f} s sim vs "
        f"{result['makespan_recorded_s']:.0f} s rec; KS {result['completion_ks']:.3f}",
        fontsize=9,
    )
    axes[1].set_title(f"profile {cost.name}", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return result


def load_step(path: Path) -> list[TrajectoryRecord]:
    records = list(read_multiturn(path))  # one without any is refused by its reader
    untimed = [
        (i, k)
        for i, r in enumerate(records)
        for k, t in enumerate(r.turns)
        if t.engine_latency_s is None
    ]
    if untimed:  # read as 0 s: a replay of the tool latency alone came out "99.9% accurate"
        i, k = untimed[0]
        raise TraceFormatError(
            path,
            line_of_record(path, i),
            f"turns.{k}.engine_latency_s",
            f"missing in {len(untimed)} of {sum(len(r.turns) for r in records)} turns: validate "
            "compares the engine model with each turn's recorded engine latency (a trace made by "
            "`toolenv gateway trace-to-multiturn` records the tool calls alone: replay it with "
            "`toolenv rollout run --trace`)",
        )
    step = records[0].step
    other = next((i for i, r in enumerate(records) if r.step != step), None)
    if other is not None:  # replayed as one step launched at once: the load of both together
        raise TraceFormatError(
            path,
            line_of_record(path, other),
            "step",
            f"{records[other].step}, where line {line_of_record(path, 0)} is of step {step}: "
            "validate replays one recorded step a file (split the file by step)",
        )
    if recorded_timings(records)[0].max() <= 0:
        # nothing to compare with: it failed later on a ZeroDivisionError
        raise TraceFormatError(
            path, 0, "", "records no timings (engine_latency_s, latency_s): nothing to validate"
        )
    return records


def replay_loss(result: dict[str, Any]) -> float:
    """Makespan error and completion-time KS weigh alike; turn p50/p90 errors keep turns honest."""
    rec, sim = result["turn_latency_recorded_s"], result["turn_latency_simulated_s"]
    turn_err = np.mean([abs(sim[k] - rec[k]) / max(rec[k], 1e-9) for k in ("p50", "p90")])
    return (1 - result["makespan_accuracy"]) + result["completion_ks"] + 0.5 * float(turn_err)


def initial_guess(records: list[TrajectoryRecord], start: CostModel) -> CostModel:
    """Coefficients read off turn 0, where every request arrives at once.

    Regressing turn 0's engine latency on its output length gives an intercept (the whole step's
    prompts prefilled before decoding starts) and a slope (one decode iteration at full batch).
    """
    first = [min(r.turns, key=lambda t: t.turn) for r in records]  # each has one (its reader)
    tokens = np.asarray([t.completion_tokens for t in first], dtype=float)
    latency = np.asarray([t.engine_latency_s or 0.0 for t in first], dtype=float)
    slope, intercept = np.polyfit(tokens, latency, 1)
    prompts = float(sum(r.prompt_len for r in records))
    batch = len(records)
    per_seq = max(1e-6, (slope - start.decode_base_s) / batch)
    return start.model_copy(
        update={
            "prefill_per_token_s": max(1e-7, intercept / prompts),
            "decode_per_seq_s": per_seq,
            "max_batch": max(start.max_batch, batch),
        }
    )


FIT_FIELDS = ("decode_base_s", "decode_per_seq_s", "prefill_per_token_s", "max_batch")


def fit_cost_model(
    steps: list[list[TrajectoryRecord]],
    start: CostModel,
    max_evaluations: int = 80,
    on_trial: Callable[[CostModel, float], None] | None = None,
    fields: tuple[str, ...] = FIT_FIELDS,
    loss_fn: Callable[[dict[str, Any]], float] | None = None,
) -> tuple[CostModel, float]:
    """Nelder-Mead over the logarithms of the engine model's coefficients (a replay per trial)."""
    # Past the step's size a batch limit changes nothing (a flat loss the search cannot leave).
    largest = max(len(s) for s in steps)
    start = start.model_copy(update={"max_batch": min(start.max_batch, largest)})
    loss_fn = loss_fn or replay_loss
    # A coefficient at 0 has no logarithm: start it small instead.
    x0 = np.log([max(float(start.model_dump()[name]), 1e-6) for name in fields])

    def model(x: np.ndarray) -> CostModel:
        values: dict[str, Any] = dict(zip(fields, np.exp(x).tolist(), strict=True))
        if "max_batch" in values:
            values["max_batch"] = max(1, round(values["max_batch"]))
        return start.model_copy(update=values)

    def loss(x: np.ndarray) -> float:
        cost = model(x)
        value = float(np.mean([loss_fn(validate_step(s, cost)) for s in steps]))
        if on_trial is not None:
            on_trial(cost, value)
        return value

    result = scipy.optimize.minimize(
        loss,
        x0,
        method="Nelder-Mead",
        options={"maxfev": max_evaluations, "xatol": 0.02, "fatol": 0.002},
    )
    return model(result.x), float(result.fun)
