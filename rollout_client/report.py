"""Rollout reports: JSON, a human table, and PNG plots (makespan per step, completion CDF,
engine-busy timeline)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from toolenv_core.console import report_console
from toolenv_core.outputs import write_whole
from toolenv_core.plotting import pyplot

MAKESPAN_PNG, COMPLETION_PNG, BUSY_PNG = "makespan.png", "completion_cdf.png", "engine_busy.png"
PLOTS = (MAKESPAN_PNG, COMPLETION_PNG, BUSY_PNG)
"""Every plot `plot` draws, by file name."""
LABELLED_STEPS = 12  # past this many steps, the plots show the steps as an axis, not by name
MAX_WIDTH_IN = 12.0  # the per-step makespan bars' figure, at most (1,200 pixels)


def drop_plots_not_written(out: Path, names: Iterable[str], written: Iterable[Path]) -> None:
    """Remove from `out` the report's plots (`names`) that this run did not write: `--no-plots`
    into an earlier run's directory left its PNGs beside the new report, describing another run."""
    kept = {path.name for path in written}
    for name in names:
        if name not in kept:
            (out / name).unlink(missing_ok=True)


def write_json(report: dict[str, Any], path: Path) -> None:
    write_whole(path, json.dumps(report, indent=2) + "\n")


_ROWS: list[tuple[str, str]] = [
    ("completed", "completed"),
    ("launched", "launched"),
    ("modeled_makespan_s", "makespan ({modelled}s)"),
    ("wall_s", "wall time (s)"),
    ("trajectories_per_s", "trajectories/s"),
    ("tokens_per_s", "generated tokens/s"),
    ("engine_busy_fraction", "engine busy"),
    ("in_flight", "mean in flight / capacity"),
    ("share:generate", "time generating"),
    ("share:queue", "time queueing"),
    ("share:tool_wait", "time waiting on tools"),
    ("share:barrier_wait", "time at the sync barrier"),
    ("tail_share", "tail share (last 10%)"),
    ("tool_timeouts", "tool timeouts"),
    ("tool_errors", "tool errors"),
    ("tool_calls_abandoned", "calls left in flight"),
    ("aborted", "aborted"),
    ("carried", "carried over"),
    ("wasted_tokens", "wasted tokens"),
    ("staleness", "staleness (steps: count)"),
    ("prefix_hit_rate", "prefix-cache hit rate"),
]
_PERCENT = {"engine_busy_fraction", "tail_share", "prefix_hit_rate"}


def _cell(step: dict[str, Any], key: str) -> str:
    if key.startswith("share:"):
        return f"{step['time_share'][key.removeprefix('share:')]:.0%}"
    if key == "staleness":
        return " ".join(f"{k}:{v}" for k, v in step["staleness"].items()) or "-"
    if key == "in_flight":
        capacity = step.get("capacity")
        share = f" ({step['mean_batch_occupancy']:.1%})" if capacity else ""
        return f"{step['mean_in_flight']:.1f} / {capacity or '?'}{share}"
    if key == "prefix_hit_rate":
        cache = step.get("prefix_cache")
        return f"{cache['hit_rate']:.0%}" if cache else "-"
    value = step[key]
    if value is None:
        return "-"
    if key in _PERCENT:
        return f"{value:.0%}"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def modelled(report: dict[str, Any]) -> str:
    """The word for the simulator's times, "modelled "; none for a real engine's, which are
    measured (its table said "makespan, modelled (s)" of vLLM's measured makespan)."""
    return "modelled " if report.get("engine") == "sim" else ""


def table(report: dict[str, Any], max_steps: int = 6) -> Table:
    """One row per metric, one column per step (narrow terminals stay readable)."""
    scale = report.get("time_scale", 1.0)
    note = f" (sim at {scale:g}x real time)" if scale != 1.0 else ""
    if report.get("clock") == "virtual":
        note = " (virtual time: modelled seconds; wall time beside)"
    t = Table(
        title=f"rollout: policy {report['policy']}, engine {report['engine']}{note}",
        title_justify="left",
    )
    t.add_column("metric")
    walls = report.get("wall", {}).get("steps_s", [])
    steps = [
        {**s, "wall_s": walls[i] if i < len(walls) else None}
        for i, s in enumerate(report["steps"][:max_steps])
    ]
    for s in steps:
        t.add_column(f"step {s['step']}", justify="right")
    for key, label in _ROWS:
        t.add_row(label.format(modelled=modelled(report)), *(_cell(s, key) for s in steps))
    hidden = report["steps"][max_steps:]
    if hidden:  # the summary line under the table counts every step
        first, last = hidden[0]["step"], hidden[-1]["step"]
        which = f"step {first}" if first == last else f"steps {first}-{last}"
        t.caption = f"{which} not shown (report.json has every step)"
        t.caption_justify = "left"
    return t


def print_table(report: dict[str, Any], console: Console | None = None) -> None:
    (console or report_console()).print(table(report))


def plot(report: dict[str, Any], timelines: list[list[tuple[float, int]]], out: Path) -> list[Path]:
    plt = pyplot()

    paths = []
    steps = report["steps"]
    title = f"{report['policy']} / {report['engine']}"

    # Plots are in modelled seconds: a step's figures are already (`metrics.in_modelled_time`);
    # the engine's in-flight timelines are on the run's own clock, `time_scale` times faster.
    scale = report.get("time_scale", 1.0)
    # Up to LABELLED_STEPS a bar and a legend entry per step; past them the figure keeps its
    # width and the steps are an axis: 600 steps drew a 72,200-pixel-wide bar chart and a CDF
    # under a legend of 600 entries.
    many = len(steps) > LABELLED_STEPS
    fig, ax = plt.subplots(figsize=(min(MAX_WIDTH_IN, max(3.5, 1.2 * len(steps) + 2)), 3.5))
    heights = [s["modeled_makespan_s"] for s in steps]
    if many:
        ax.bar([s["step"] for s in steps], heights, color="tab:blue", width=0.8)
        ax.set_xlabel("step")
    else:
        labels = [f"step {s['step']}" for s in steps]
        ax.bar(labels, heights, color="tab:blue", width=0.6)
    ax.set_ylabel(f"makespan ({modelled(report)}s)")
    ax.set_title(f"per-step makespan: {title}")
    fig.tight_layout()
    paths.append(out / MAKESPAN_PNG)
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    # many steps: each curve's colour says its step (a colour bar), not a legend entry
    by_step = plt.cm.ScalarMappable(
        norm=plt.Normalize(steps[0]["step"], steps[-1]["step"]) if steps else None,
        cmap="viridis",
    )
    for s in steps:
        times = s["completion_times_s"]
        if times:  # from (0, 0): one trajectory, or all finishing together, is still a curve
            ax.step(
                [0.0, *times],
                [0.0] + [(i + 1) / len(times) for i in range(len(times))],
                where="post",
                label=f"step {s['step']}",
                **({"color": by_step.to_rgba(s["step"]), "lw": 0.8} if many else {}),
            )
    ax.set_xlabel(f"{modelled(report)}seconds since step start")
    ax.set_ylabel("fraction of trajectories done")
    ax.set_title(f"trajectory completion CDF: {title}")
    if many:
        fig.colorbar(by_step, ax=ax, label="step")
    else:
        ax.legend(fontsize="small")
    fig.tight_layout()
    paths.append(out / COMPLETION_PNG)
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    offset = 0.0
    capacity = report.get("engine_capacity") or 1
    for s, points in zip(steps, timelines, strict=False):
        if points:
            ax.step(
                [offset + t * scale for t, _ in points],
                [100 * n / capacity for _, n in points],
                where="post",
                color="tab:green",
            )
            ax.axvline(offset, color="grey", lw=0.5)
        offset += s["modeled_makespan_s"]
    ax.set_xlabel(f"{modelled(report)}seconds (steps back to back)")
    ax.set_ylabel(f"in flight / capacity {capacity} (%)")
    ax.set_title(f"engine-busy timeline: {title}")
    fig.tight_layout()
    paths.append(out / BUSY_PNG)
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
