"""The study's report: `study.json`, `study.md` (one table per scenario) and PNG plots.

Plots: the Pareto front of speed-up over turn-synchronous against the share of tool calls cut
(one panel per scenario), speed-up per policy side by side across scenarios, and batch occupancy
(requests in flight over engine capacity) over the first step for sync, async and the
recommended policy. Every time is modelled seconds (the rollout's own clock); the wall time each
cell took to simulate is beside it in the JSON.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolenv_core.console import counted
from toolenv_core.flocks import reap_unheld
from toolenv_core.plotting import pyplot

from .report import drop_plots_not_written
from .study import HANG_S

PARETO_PNG, SPEEDUP_PNG, OCCUPANCY_PNG = "pareto.png", "speedup.png", "occupancy.png"
PLOTS = (PARETO_PNG, SPEEDUP_PNG, OCCUPANCY_PNG)
"""Every plot `plot` draws, by file name."""
STAGING = ".study-"
"""The prefix of `write`'s staging directories in `--out`."""
ABANDONED_AFTER_S = 60.0


def _rate_text(value: float) -> str:
    """Trajectories/s to 2 decimals, or 2 significant digits below 0.1 (a slow cell read 0.00)."""
    return f"{value:.2f}" if value >= 0.1 else f"{value:#.2g}"


_COLUMNS: list[tuple[str, str, str | Callable[[Any], str]]] = [
    ("policy", "policy", "{}"),
    ("makespan_s", "step makespan (s)", "{:.1f}"),
    ("trajectories_per_s", "traj/s", _rate_text),
    ("speedup_over_sync", "speed-up", "{:.2f}x"),
    ("mean_batch_occupancy", "occupancy", "{:.0%}"),
    ("tail_share", "tail share", "{:.0%}"),
    ("calls_cut_share", "calls cut", "{:.1%}"),
    ("calls_abandoned", "calls left in flight", "{}"),
    ("duplicate_calls", "hedges sent", "{}"),
    ("mean_staleness", "staleness", "{:.2f}"),
    ("wasted_tokens", "wasted tokens", "{}"),
]


def _fmt(template: str | Callable[[Any], str], value: Any) -> str:
    if value is None:
        return "-"
    return template(value) if callable(template) else template.format(value)


def markdown(study: dict[str, Any], command: str) -> str:
    meta = study["study"]
    lines = [
        "# Rollout straggler study (virtual time)",
        "",
        f"`{command}`",
        "",
        f"{counted(meta['steps'], 'step')} of {counted(meta['batch'], 'trajectory')} per cell, "
        f"cost profile "
        f"`{meta['cost_profile']}`, seed {meta['seed']}. Times are modelled seconds; occupancy is "
        "requests in flight over engine capacity; speed-up is trajectories/s over turn-synchronous "
        "(sync) in the same scenario; calls cut are tool calls ended by a deadline (a hang with no "
        f"deadline ends at {HANG_S:g} s, cut too); calls left in flight, not in that share, are "
        "calls still unanswered when over-sampling closed a step (summed over steps): cancelled "
        "with their trajectory, made again when it is carried over, lost with it when aborted; "
        "staleness is policy versions per completed trajectory as a longer run would see it "
        "(trajectories carried across a step close, the last step's included, over those "
        "completed).",
        "",
    ]
    failed = [c for c in study["cells"] if c.get("failed")]
    if failed:
        lines += [
            f"**Trajectories failed in {counted(len(failed), 'cell')}**; their figures count "
            "only what finished: "
            + "; ".join(
                f"{c['scenario']} / {c['policy']}: {c['failed']} ({c['first_failure']})"
                for c in failed
            ),
            "",
        ]
    for name, title in meta["scenarios"].items():
        rows = [c for c in study["cells"] if c["scenario"] == name]
        rec = study["recommendations"][name]
        lines += [f"## {title}", ""]
        lines.append("| " + " | ".join(label for _, label, _ in _COLUMNS) + " |")
        lines.append("|" + "---|" * len(_COLUMNS))
        for row in rows:
            lines.append("| " + " | ".join(_fmt(t, row[k]) for k, _, t in _COLUMNS) + " |")
        budget = "" if rec["within_cut_budget"] else " (no policy stays within 1% of calls cut)"
        left = rec.get("calls_abandoned") or 0
        in_flight = f", {counted(left, 'call')} left in flight at step closes" if left else ""
        # abort's price: without it an abort policy read as free (no cut, staleness 0.00)
        wasted = rec.get("wasted_tokens") or 0
        thrown = f", {wasted:,} generated tokens thrown away (aborted)" if wasted else ""
        lines += [
            "",
            f"Recommendation: **{rec['policy']}**: "
            f"{_fmt('{:.2f}x', rec['speedup_over_sync'])} over sync, "
            f"{rec['calls_cut_share']:.1%} of calls cut{in_flight}, mean staleness "
            f"{rec['mean_staleness']:.2f} steps{thrown}{budget}.",
            "",
        ]
    if meta.get("skipped"):
        lines.append(f"Skipped (no data given): {', '.join(meta['skipped'])}.")
    return "\n".join(lines) + "\n"


def write(study: dict[str, Any], out: Path, command: str, plots: bool = True) -> list[Path]:
    """Every file is made in a staging directory under `out` and renamed into place at the end,
    study.json last: Ctrl-C while plotting (the slow part) leaves no file of this report, and
    this study.json is in place only once the rest is. An earlier study's plots that this one
    does not draw (`--no-plots`) are removed before it: they would describe another study."""
    out.mkdir(parents=True, exist_ok=True)
    _reap_staging(out)
    staging = Path(tempfile.mkdtemp(prefix=STAGING, dir=out))
    held = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # ours while we write: another study's reaper skips it
        (staging / "study.md").write_text(markdown(study, command))
        if plots:
            plot(study, staging)
        (staging / "study.json").write_text(json.dumps(study, indent=2) + "\n")
        *rest, last = sorted(staging.iterdir(), key=lambda p: p.name == "study.json")
        placed = [p.replace(out / p.name) for p in rest]
        drop_plots_not_written(out, PLOTS, placed)
        return [*placed, last.replace(out / last.name)]
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        os.close(held)


def _reap_staging(out: Path) -> None:
    """Remove the staging directories of studies killed outright (SIGKILL, a power cut): each
    left a hidden `.study-*` holding its part of a report in `out` for good. One that a live
    study writes is locked."""
    reap_unheld(
        out.glob(f"{STAGING}*"),
        lambda path: shutil.rmtree(path, ignore_errors=True),
        older_than_s=ABANDONED_AFTER_S,
    )


def plot(study: dict[str, Any], out: Path) -> list[Path]:
    plt = pyplot()

    cells = study["cells"]
    scenarios = list(study["study"]["scenarios"])
    titles = study["study"]["scenarios"]
    policies = list(dict.fromkeys(c["policy"] for c in cells))
    paths: list[Path] = []

    cols = min(3, len(scenarios))
    rows = -(-len(scenarios) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax, name in zip(axes.flat, scenarios, strict=False):
        at: dict[tuple[float, float], list[str]] = {}
        for c in (c for c in cells if c["scenario"] == name):
            xy = (100 * c["calls_cut_share"], c["speedup_over_sync"] or 0)
            ax.scatter(*xy, s=18)
            at.setdefault(xy, []).append(c["policy"])
        for xy, names in at.items():  # policies at one point wrote their names over each other
            ax.annotate("\n".join(names), xy, fontsize=6, xytext=(3, 2),
                        textcoords="offset points", va="bottom")  # fmt: skip
        ax.axvline(1.0, color="grey", lw=0.6, ls="--")
        ax.axhline(1.0, color="grey", lw=0.6)
        ax.set_title(titles[name], fontsize=9)
        ax.set_xlabel("tool calls cut (%)")
        ax.set_ylabel("speed-up over sync")
    for ax in list(axes.flat)[len(scenarios) :]:
        ax.axis("off")
    fig.suptitle("speed-up against calls cut (dashed: the 1% budget)")
    fig.tight_layout()
    paths.append(out / PARETO_PNG)
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(policies)), 4.5))
    width = 0.8 / max(1, len(scenarios))
    for i, name in enumerate(scenarios):
        by = {c["policy"]: c["speedup_over_sync"] or 0 for c in cells if c["scenario"] == name}
        xs = [j + i * width for j in range(len(policies))]
        ax.bar(xs, [by.get(p, 0) for p in policies], width, label=titles[name])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(policies))])
    ax.set_xticklabels(policies, rotation=35, ha="right", fontsize=7)
    ax.axhline(1.0, color="grey", lw=0.6)
    ax.set_ylabel("speed-up over sync (trajectories/s)")
    ax.set_title("policies side by side, per tool scenario")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / SPEEDUP_PNG)
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, name in zip(axes.flat, scenarios, strict=False):
        best = study["recommendations"][name]["policy"]
        for label in dict.fromkeys(["sync", "async", best]):
            row = next((c for c in cells if c["scenario"] == name and c["policy"] == label), None)
            if row and row["occupancy_timeline"]:
                t, y = zip(*row["occupancy_timeline"], strict=True)
                ax.step(t, [100 * v for v in y], where="post", label=label, lw=1)
        ax.set_title(titles[name], fontsize=9)
        ax.set_xlabel("modelled seconds (first step)")
        ax.set_ylabel("in flight / capacity (%)")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(scenarios) :]:
        ax.axis("off")
    fig.suptitle("batch occupancy over time (the GPU-idle proxy)")
    fig.tight_layout()
    paths.append(out / OCCUPANCY_PNG)
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
