"""Rollout reports: JSON, a human table, and PNG plots (makespan per step, completion CDF,
engine-busy timeline)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=2) + "\n")


def table(report: dict[str, Any]) -> Table:
    t = Table(
        title=f"rollout: policy {report['policy']}, engine {report['engine']}", title_justify="left"
    )
    columns = (
        "step",
        "done",
        "makespan",
        "traj/s",
        "tok/s",
        "busy",
        "occ",
        "gen/q/tool/bar",
        "tail",
        "t/o",
        "abort",
        "carry",
        "waste",
    )
    for col in columns:
        t.add_column(col, justify="right")
    for s in report["steps"]:
        share = s["time_share"]
        t.add_row(
            str(s["step"]),
            str(s["completed"]),
            f"{s['makespan_s']:.2f}",
            f"{s['trajectories_per_s']:.2f}",
            f"{s['tokens_per_s']:.0f}",
            f"{s['engine_busy_fraction']:.0%}",
            f"{s['mean_batch_occupancy']:.0%}",
            f"{share['generate']:.0%}/{share['queue']:.0%}/{share['tool_wait']:.0%}/{share['barrier_wait']:.0%}",
            f"{s['tail_share']:.0%}",
            str(s["tool_timeouts"]),
            str(s["aborted"]),
            str(s["carried"]),
            str(s["wasted_tokens"]),
        )
    return t


def print_table(report: dict[str, Any], console: Console | None = None) -> None:
    (console or Console()).print(table(report))


def plot(report: dict[str, Any], timelines: list[list[tuple[float, int]]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    steps = report["steps"]
    title = f"{report['policy']} / {report['engine']}"

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([s["step"] for s in steps], [s["makespan_s"] for s in steps], color="tab:blue")
    ax.set_xlabel("step")
    ax.set_ylabel("makespan (s)")
    ax.set_title(f"per-step makespan: {title}")
    fig.tight_layout()
    paths.append(out / "makespan.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for s in steps:
        times = s["completion_times_s"]
        if times:
            ax.step(
                times,
                [(i + 1) / len(times) for i in range(len(times))],
                where="post",
                label=f"step {s['step']}",
            )
    ax.set_xlabel("seconds since step start")
    ax.set_ylabel("fraction of trajectories done")
    ax.set_title(f"trajectory completion CDF: {title}")
    ax.legend(fontsize="small")
    fig.tight_layout()
    paths.append(out / "completion_cdf.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    offset = 0.0
    for s, points in zip(steps, timelines, strict=False):
        if points:
            ax.step(
                [offset + t for t, _ in points],
                [n for _, n in points],
                where="post",
                color="tab:green",
            )
            ax.axvline(offset, color="grey", lw=0.5)
        offset += s["makespan_s"]
    ax.set_xlabel("seconds (steps back to back)")
    ax.set_ylabel("requests in the engine")
    ax.set_title(f"engine-busy timeline: {title}")
    fig.tight_layout()
    paths.append(out / "engine_busy.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
