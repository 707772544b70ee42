"""The run report: its summary figures read over the whole run, and its PNGs draw the figures
the report holds, on the axes their labels name."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot
import pytest
from rollout_support import plan

from rollout_client.clock import run_virtual
from rollout_client.report import COMPLETION_PNG, plot, table
from rollout_client.session import run_rollout
from rollout_client.settings import RolloutSettings
from rollout_client.simtools import SimTools, ToolModel


async def test_completion_cdf_at_a_time_scale_ends_at_the_modelled_makespan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At --time-scale X the report's completion times are modelled seconds already: the plot
    multiplied them by X again, so the CDF ran X times past the makespan beside it."""
    settings = RolloutSettings(
        engine="sim", cost_profile="vllm-cpu-tiny", time_scale=20, batch=4, policy="async"
    )
    plans = [plan(f"t{i}", 64, [(16, 0.01 * i), (8, None)]) for i in range(4)]
    report = await run_rollout(settings, iter(plans), tools=SimTools({}, default=ToolModel()))
    [step] = report["steps"]
    assert report["time_scale"] == 20 and step["completed"] == 4
    drawn: dict[str, object] = {}
    monkeypatch.setattr(matplotlib.pyplot, "close", lambda fig: drawn.update({fig.axes[0]: fig}))
    paths = plot(report, report["_timelines"], tmp_path)
    [cdf] = [ax for ax in drawn if ax.get_title().startswith("trajectory completion CDF")]
    assert tmp_path / COMPLETION_PNG in paths
    [line] = cdf.get_lines()
    assert cdf.get_xlabel() == "modelled seconds since step start"
    assert max(line.get_xdata()) == pytest.approx(max(step["completion_times_s"]))
    assert max(line.get_xdata()) <= step["modeled_makespan_s"] + 1e-6


def test_summary_busy_and_occupancy_are_over_the_runs_time() -> None:
    """The summary took the plain mean of the steps' fractions: a short idle step weighed as
    much as a long busy one, so "N trajectories in T modelled s; engine busy X%" misread T."""
    settings = RolloutSettings(engine="sim", clock="virtual", exact=True, batch=2, steps=2)
    busy = [plan(f"long{i}", 64, [(3000, None)]) for i in range(2)]
    waiting = [plan(f"wait{i}", 64, [(4, 30.0), (4, None)]) for i in range(2)]
    report = run_virtual(run_rollout(settings, iter(busy + waiting)))
    first, second = report["steps"]
    assert first["engine_busy_fraction"] > 0.9 > 0.5 > second["engine_busy_fraction"]
    summary = report["summary"]
    total = first["makespan_s"] + second["makespan_s"]
    for key in ("engine_busy_fraction", "mean_batch_occupancy"):
        weighted = (first[key] * first["makespan_s"] + second[key] * second["makespan_s"]) / total
        assert summary[key] == pytest.approx(weighted, abs=1e-4)


def test_a_run_of_many_steps_keeps_its_plots_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """600 steps drew a 72,200-pixel-wide makespan chart (a bar and a name per step) and the
    completion CDF under a legend of 600 entries that covered it. Past a dozen steps the steps
    are an axis: the chart keeps a screen's width, each CDF's colour is its step (a colour bar)."""
    steps = [
        {"step": i, "modeled_makespan_s": 1.0 + i % 5, "completion_times_s": [0.5, 1.0]}
        for i in range(100)
    ]
    report = {"policy": "async", "engine": "sim", "engine_capacity": 8, "steps": steps}
    drawn: dict[str, object] = {}
    monkeypatch.setattr(
        matplotlib.pyplot, "close", lambda fig: drawn.update({fig.axes[0].get_title(): fig})
    )
    plot(report, [[(0.0, 1), (1.0, 0)]] * len(steps), tmp_path)
    bars = drawn["per-step makespan: async / sim"]
    assert bars.get_figwidth() <= 12
    assert [p.get_height() for p in bars.axes[0].patches] == [
        s["modeled_makespan_s"] for s in steps
    ]
    cdf = drawn["trajectory completion CDF: async / sim"]
    assert cdf.axes[0].get_legend() is None and len(cdf.axes[0].get_lines()) == 100
    [colorbar] = cdf.axes[1:]
    assert colorbar.get_ylabel() == "step"


@pytest.mark.parametrize(("engine", "word"), [("sim", "modelled "), ("vllm", ""), ("openai", "")])
def test_a_real_engines_times_are_not_called_modelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str, word: str
) -> None:
    """vLLM's measured makespan was "makespan, modelled (s)" in the table and the plots."""
    settings = RolloutSettings(engine="sim", clock="virtual", exact=True, batch=2, steps=1)
    report = run_virtual(
        run_rollout(settings, iter([plan(f"t{i}", 64, [(8, None)]) for i in range(2)]))
    )
    report["engine"] = engine  # what the labels go by: the figures are a real engine's alike
    [label_column, _] = table(report).columns
    assert f"makespan ({word}s)" in list(label_column.cells)
    drawn: list[str] = []
    monkeypatch.setattr(
        matplotlib.pyplot,
        "close",
        lambda fig: drawn.extend(f"{ax.get_xlabel()} | {ax.get_ylabel()}" for ax in fig.axes),
    )
    plot(report, report["_timelines"], tmp_path)
    capacity = report["engine_capacity"]
    assert drawn == [
        f" | makespan ({word}s)",
        f"{word}seconds since step start | fraction of trajectories done",
        f"{word}seconds (steps back to back) | in flight / capacity {capacity} (%)",
    ]
