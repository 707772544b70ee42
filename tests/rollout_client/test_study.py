"""`toolenv rollout study --quick`: the whole matrix in virtual time, as a user runs it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import matplotlib.figure
import matplotlib.pyplot
import numpy as np
import pytest
from rollout_support import endless_cost_profile, first_records, sigterm_once, write_trace
from typer.testing import CliRunner

from rollout_client import study, study_report
from rollout_client.engines import BUILTIN_PROFILES
from rollout_client.metrics import summarize
from rollout_client.simtools import SimTools
from rollout_client.study import StudyPlan, load_plans
from rollout_client.study_report import markdown
from toolenv.cli import build_app
from toolenv_core.sigterm import Terminated

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_quick_study_writes_the_matrix_and_its_findings(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    search = polytrace_dir / "search_r1"
    cmd = [
        sys.executable, "-m", "toolenv", "rollout", "study", "--quick",
        "--trace", str(search / "multiturn_workload_step_0.jsonl"),
        "--trace", str(search / "multiturn_workload_step_1.jsonl"),
        "--reward-trace", str(polytrace_dir / "rllm_deepcoder" / "reward_timings_step_0.jsonl"),
        "--out", str(tmp_path), "--json",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    study = json.loads(done.stdout)
    for name in ("study.json", "study.md", "pareto.png", "speedup.png", "occupancy.png"):
        assert (tmp_path / name).stat().st_size > 0
    cells = {(c["scenario"], c["policy"]): c for c in study["cells"]}
    scenarios = ["recorded", "x10", "x100", "hangs", "reward"]
    assert sorted({s for s, _ in cells}) == sorted(scenarios)
    assert len(cells) == 5 * 7
    for s in scenarios:
        assert cells[(s, "sync")]["speedup_over_sync"] == 1.0
        assert cells[(s, "sync")]["trajectories_per_s"] > 0
        # over-sampling closes the step on the first N: never slower than waiting for all
        assert cells[(s, "overlap 25% carry")]["makespan_s"] < cells[(s, "async")]["makespan_s"]
        # Steady-state staleness: each step carries N' - N = 25% of N across its close, the
        # last step's included (over the finished ones alone, two steps read about half); a
        # few more than N may finish at the closing instant.
        assert abs(cells[(s, "overlap 25% carry")]["mean_staleness"] - 0.25) <= 0.01
        assert 56 <= cells[(s, "overlap 25% carry")]["carried_at_end"] <= 64
        assert cells[(s, "overlap 25% abort")]["mean_staleness"] == 0
        assert cells[(s, "overlap 25% abort")]["wasted_tokens"] > 0
        assert cells[(s, "overlap 25% carry")]["wasted_tokens"] == 0
        assert cells[(s, "async")]["duplicate_calls"] == 0
        assert s in study["recommendations"]
    # A deadline at the p99 of the scenario's own latencies cuts about 1% of the calls.
    assert 0.003 < cells[("recorded", "timeout p99")]["calls_cut_share"] < 0.03
    assert cells[("recorded", "async")]["calls_cut_share"] == 0
    # Hedging sends duplicates only where it is on, and rescues hung calls.
    assert cells[("hangs", "hedge p95")]["duplicate_calls"] > 0
    assert (
        cells[("hangs", "hedge p95")]["calls_cut_share"]
        < cells[("hangs", "async")]["calls_cut_share"]
    )
    # Over-sampling closes steps on hung calls: left in flight, never reported as answered.
    assert cells[("hangs", "overlap 25% abort")]["calls_abandoned"] > 0
    assert cells[("hangs", "async")]["calls_abandoned"] == 0
    assert "calls left in flight" in (tmp_path / "study.md").read_text()
    # Tools 100x slower make the turn-synchronous barrier costlier: async gains more.
    assert cells[("x100", "sync")]["makespan_s"] > cells[("recorded", "sync")]["makespan_s"]
    md = (tmp_path / "study.md").read_text()
    assert "toolenv rollout study" in md and "Recommendation" in md
    # Every trajectory of every cell finished: a cell's failures were counted nowhere (a seed of -1
    # failed every tool call and the study still exited 0 with its figures).
    assert all(c["failed"] == 0 and c["first_failure"] is None for c in cells.values())
    assert "failed" not in md
    cell = study["cells"][3]
    cell.update(failed=2, first_failure="ValueError: boom")
    assert (
        f"**Trajectories failed in 1 cell**; their figures count only what finished: "
        f"{cell['scenario']} / {cell['policy']}: 2 (ValueError: boom)"
    ) in markdown(study, "toolenv rollout study")


@pytest.mark.parametrize("option", [["--steps", "0"], ["--steps", "-1"], ["--batch", "0"]])
def test_a_study_of_no_steps_or_no_trajectories_is_bad_input(
    polytrace_dir: Path, tmp_path: Path, option: list[str]
) -> None:
    """It ran the matrix and died on an IndexError (`index -1 is out of bounds`)."""
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    args = ["rollout", "study", "--quick", "--trace", str(trace), "--out", str(tmp_path / "o")]
    done = CliRunner().invoke(build_app(), [*args, *option])
    assert done.exit_code == 2, (done.output, done.exception)
    assert f"Invalid value for '{option[0]}'" in done.stderr and "Traceback" not in done.output
    assert not (tmp_path / "o").exists()


def test_a_trace_too_short_for_the_over_sampled_cells_is_bad_input(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """20 trajectories passed the check for 2 steps of 8 (16), but over-sampling by 50% launches
    12 a step: its cells ran short, silently, and were ranked against cells that ran in full."""
    trace = write_trace(first_records(polytrace_dir, 20), tmp_path / "t.jsonl")
    args = ["rollout", "study", "--quick", "--trace", str(trace), "--out", str(tmp_path / "o")]
    done = CliRunner().invoke(build_app(), [*args, "--batch", "8", "--steps", "2"])
    assert done.exit_code == 2, (done.output, done.exception)
    assert "the traces hold 20 trajectories" in done.stderr and "need 24" in done.stderr
    assert not (tmp_path / "o").exists()
    plan = StudyPlan.quick([trace], [])
    plan.batch = 8
    with pytest.raises(ValueError, match="need 24"):
        load_plans(plan)


def test_bad_input_is_the_one_line_on_stderr(polytrace_dir: Path, tmp_path: Path) -> None:
    """The error was written while the progress bar was live: into the bar's line on a terminal,
    and the bar ("study 0/N", as if the study were about to run) redrawn under it."""
    trace = write_trace(first_records(polytrace_dir, 4), tmp_path / "t.jsonl")
    args = ["rollout", "study", "--trace", str(trace), "--out", str(tmp_path / "o")]
    done = CliRunner().invoke(build_app(), [*args, "--batch", "8", "--steps", "1"])
    assert done.exit_code == 2, (done.output, done.exception)
    assert done.stderr.startswith("error: the traces hold 4 trajectories")
    assert done.stderr.count("\n") == 1, done.stderr
    # a cost profile that does not load: found before the bar too (each cell loads it)
    profile = tmp_path / "cost.json"
    profile.write_text('{"name": "x"')
    small = ["--batch", "2", "--steps", "1", "--quick"]  # traces enough for these
    done = CliRunner().invoke(build_app(), [*args, *small, "--cost-profile", str(profile)])
    assert done.exit_code == 2, (done.output, done.exception)
    assert (
        done.stderr
        == f"error: cost profile {profile} does not parse: Expecting ',' delimiter: line 1 column 13 (char 12)\n"
    )


def test_a_cost_profile_whose_iterations_never_end_is_bad_input(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """Iterations of 1e308 s passed the virtual clock's horizon: a VirtualTimeDeadlock traceback."""
    profile = endless_cost_profile(tmp_path / "cost.json")
    trace = write_trace(first_records(polytrace_dir, 40), tmp_path / "t.jsonl")
    args = ["rollout", "study", "--quick", "--trace", str(trace), "--out", str(tmp_path / "o")]
    done = CliRunner().invoke(
        build_app(), [*args, "--batch", "8", "--steps", "1", "--cost-profile", str(profile)]
    )
    assert done.exit_code == 2, (done.output, done.exception)
    assert done.stderr.startswith("error: virtual time passed") and "Traceback" not in done.output
    assert not (tmp_path / "o").exists()


def test_a_trace_without_tool_calls_is_bad_input(polytrace_dir: Path, tmp_path: Path) -> None:
    """The study varies tool latency: trajectories that call no tool left its quantiles nothing to
    read, and it died on numpy's `IndexError: index -1 is out of bounds`."""
    records = first_records(polytrace_dir, 20, min_turns=1)
    for r in records:
        r.update(turns=r["turns"][:1], tool_calls=[], tool_call_count=0, turn_count=1)
    trace = write_trace(records, tmp_path / "t.jsonl")
    args = ["rollout", "study", "--quick", "--trace", str(trace), "--out", str(tmp_path / "o")]
    done = CliRunner().invoke(build_app(), [*args, "--batch", "8", "--steps", "1"])
    assert done.exit_code == 2, (done.output, done.exception)
    assert "none makes a tool call" in done.stderr and "Traceback" not in done.output
    assert not (tmp_path / "o").exists()


def test_an_interrupted_write_leaves_the_previous_report_or_none(
    polytrace_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while the plots were drawn left study.json and study.md (and the plots drawn so
    far) in a fresh --out, or beside the previous run's plots in an old one."""

    def interrupted(study: dict, out: Path) -> list[Path]:
        (out / "pareto.png").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(study_report, "plot", interrupted)
    trace = write_trace(first_records(polytrace_dir, 24), tmp_path / "t.jsonl")
    old = tmp_path / "old"
    old.mkdir()
    (old / "study.json").write_text("previous")
    for out in (tmp_path / "fresh", old):
        args = ["rollout", "study", "--quick", "--trace", str(trace), "--out", str(out)]
        done = CliRunner().invoke(build_app(), [*args, "--batch", "8", "--steps", "1"])
        assert done.exit_code != 0 and "Traceback" not in done.output
    assert not (tmp_path / "fresh").exists()
    assert [p.name for p in old.iterdir()] == ["study.json"]
    assert (old / "study.json").read_text() == "previous"


def _step(makespan_s: float, occupancy: float, capacity: int) -> dict:
    """One step's metrics as the runner reports them (what a cell and the summary read)."""
    return {
        "makespan_s": makespan_s, "mean_batch_occupancy": occupancy,
        "mean_in_flight": occupancy * capacity, "engine_busy_fraction": 1.0, "completed": 4,
        "failed": 0, "failures": [], "aborted": 0, "tool_errors": 0,
        "tool_calls": 8, "tool_timeouts": 0, "tool_calls_abandoned": 0, "tail_share": 0.1,
        "carried": 0, "wasted_tokens": 0, "generated_tokens": 100,
    }  # fmt: skip


def test_a_cells_occupancy_weighs_each_step_by_its_makespan_as_the_run_summary_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 100 s step at 90% occupancy and a 10 s one at 10%: 82.7% of the cell's time, as the
    run summary says (before: 50%, the plain mean of the two steps, while the summary of the
    same run said 82.7%). The simulation is replaced by its report: the steps are the point."""
    steps = [_step(100.0, 0.9, 200), _step(10.0, 0.1, 200)]
    report = {
        "steps": steps, "_timelines": [], "policy": "async", "engine_capacity": 200,
        "tools": {"hedges": 0}, "wall": {"elapsed_s": 0.1},
    }  # fmt: skip
    monkeypatch.setattr(study, "_rollout", lambda *args, **kwargs: None)
    monkeypatch.setattr(study, "run_virtual", lambda _run: dict(report))
    plan = StudyPlan([], [], batch=4, steps=2)
    tools = study.ScenarioTools(study.SCENARIOS[0], np.array([0.1, 0.2]), None)
    cost = BUILTIN_PROFILES["searchr1-qwen7b"]
    row = study.run_cell(plan, study.PolicyCell("async", "async"), tools, [], cost)
    assert row["mean_batch_occupancy"] == pytest.approx(91 / 110, abs=1e-4)
    assert row["mean_batch_occupancy"] == summarize(steps)["mean_batch_occupancy"]
    assert row["mean_in_flight"] == pytest.approx(200 * 91 / 110, abs=0.05)


def test_a_recommended_abort_policy_names_the_tokens_it_throws_away() -> None:
    """In `--quick` the recommendation is `overlap 25% abort` in four scenarios; its line read
    "0.0% of calls cut, mean staleness 0.00 steps", abort's price (the aborted trajectories'
    generated tokens, in the table and the JSON) left out."""
    meta = {
        "steps": 2, "batch": 256, "cost_profile": "searchr1-qwen7b", "seed": 0,
        "scenarios": {"recorded": "recorded search latency", "x10": "search latency x10"},
    }  # fmt: skip
    rec = {
        "speedup_over_sync": 2.141, "calls_cut_share": 0.0, "calls_abandoned": 0,
        "mean_staleness": 0.0, "within_cut_budget": True,
    }  # fmt: skip
    study = {
        "study": meta,
        "cells": [],
        "recommendations": {
            "recorded": {**rec, "policy": "overlap 25% abort", "wasted_tokens": 33696},
            "x10": {**rec, "policy": "overlap 25% carry", "wasted_tokens": 0},
        },
    }
    lines = [line for line in markdown(study, "cmd").splitlines() if "Recommendation" in line]
    assert lines == [
        "Recommendation: **overlap 25% abort**: 2.14x over sync, 0.0% of calls cut, mean "
        "staleness 0.00 steps, 33,696 generated tokens thrown away (aborted).",
        "Recommendation: **overlap 25% carry**: 2.14x over sync, 0.0% of calls cut, mean "
        "staleness 0.00 steps.",
    ]


@pytest.mark.parametrize("zeroed", ["reward", "search"])
def test_latencies_of_0_s_at_the_deadline_quantile_are_bad_input_before_any_cell(
    polytrace_dir: Path, tmp_path: Path, zeroed: str
) -> None:
    """Reward timings of 0 s made the `timeout p99` cell's deadline 0 s: the study ran 30 cells,
    then failed with "tool_timeout_s: Input should be greater than 0"."""
    records = first_records(polytrace_dir, 40)
    if zeroed == "search":
        for record in records:
            for call in record["tool_calls"]:
                call["latency_s"] = 0.0
    trace = write_trace(records, tmp_path / "t.jsonl")
    reward = polytrace_dir / "rllm_deepcoder" / "reward_timings_step_0.jsonl"
    if zeroed == "reward":
        rows = [json.loads(line) for line in reward.open()]
        reward = write_trace([{**r, "reward_time_s": 0.0} for r in rows], tmp_path / "r.jsonl")
    args = ["rollout", "study", "--quick", "--trace", str(trace), "--reward-trace", str(reward)]
    done = CliRunner().invoke(
        build_app(), [*args, "--batch", "8", "--steps", "1", "--out", str(tmp_path / "o")]
    )
    assert done.exit_code == 2, (done.output, done.exception)
    what = "reward timings" if zeroed == "reward" else "recorded tool calls"
    assert done.stderr == (
        f"error: the {what} take 0 s at their p99: the cells with a deadline there (timeout p99) "
        "cannot set one; give timings whose p99 is above 0 s\n"
    )
    assert not (tmp_path / "o").exists()


def test_sigterm_unwinds_a_study_as_ctrl_c_does(polytrace_dir: Path, tmp_path: Path) -> None:
    """SIGTERM (`timeout`, a CI cancel) ended the study where it stood and left its fresh --out
    behind, empty; now it unwinds as Ctrl-C does (the fresh --out removed), then ends by SIGTERM."""
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "toolenv", "rollout", "study", "--quick", "--no-plots",
        "--trace", str(polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"),
        "--out", str(out),
    ]  # fmt: skip
    # --out is made before the inputs are read and the cells run
    status, stderr = sigterm_once(cmd, out.exists, "the study's --out")
    assert status == -signal.SIGTERM, stderr
    assert "Traceback" not in stderr
    assert not out.exists()


def test_sigterm_during_a_cell_ends_the_study_not_one_trajectory(
    polytrace_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM while a cell ran landed in one trajectory's task, which asyncio kept as that
    trajectory's error: the study went on, wrote its report (`trajectories failed in 1 cell, e.g.
    1 in x100 / overlap 25% carry: Terminated:`) and exited 1. Now it cancels the cell, as Ctrl-C
    does, and the command's handler is back once the cell is over. The signal is real; the
    wrapped tool call only sends it from inside the simulation, at a point the test controls."""

    def handler(_signum: int, _frame: object) -> None:  # what `sigterm_unwinds` does, bar the exit
        raise Terminated

    real_call, sent = SimTools.call, []

    async def call(self: SimTools, *args: object, **kwargs: object) -> object:
        if not sent:
            sent.append(os.kill(os.getpid(), signal.SIGTERM))
            await asyncio.sleep(0)  # the loop handles it on waking
        return await real_call(self, *args, **kwargs)

    monkeypatch.setattr(SimTools, "call", call)
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    plan = StudyPlan([trace], [], batch=8, steps=1, policies=study.QUICK_POLICIES[:2])
    inputs = study.load_inputs(plan)
    previous = signal.signal(signal.SIGTERM, handler)
    try:
        with pytest.raises(Terminated):
            study.run_study(inputs)
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_report_gives_the_command_as_a_shell_reads_it(
    polytrace_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """study.md's command line joined the arguments with spaces: `--out "my study"` read as
    `--out my study`, a command that does something else."""
    out = tmp_path / "my study"
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    args = ["rollout", "study", "--trace", str(trace), "--batch", "4", "--steps", "1"]
    args += ["--no-plots", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["toolenv", *args])  # what the study writes down
    done = CliRunner().invoke(build_app(), args)
    assert done.exit_code == 0, (done.output, done.exception)
    said = (out / "study.md").read_text().splitlines()[2]
    assert said == (
        f"`toolenv rollout study --trace {trace} --batch 4 --steps 1 --no-plots --out '{out}'`"
    )


def test_policies_at_one_point_of_the_pareto_plot_share_one_readable_label(
    polytrace_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cells with the same speed-up and calls cut (async and hedge p95 when no hedge fired,
    overlap carry and abort) wrote their names over each other: `overlap 25% cabort`."""
    drawn: list[matplotlib.figure.Figure] = []
    monkeypatch.setattr(matplotlib.pyplot, "close", drawn.append)
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    args = ["rollout", "study", "--trace", str(trace), "--quick", "--batch", "4", "--steps", "1"]
    done = CliRunner().invoke(build_app(), [*args, "--out", str(tmp_path)])
    assert done.exit_code == 0, done.output
    [pareto] = [f for f in drawn if f.get_suptitle().startswith("speed-up against calls cut")]
    cells = json.loads((tmp_path / "study.json").read_text())["cells"]
    titles = json.loads((tmp_path / "study.json").read_text())["study"]["scenarios"]
    shared = 0
    for ax in pareto.axes:
        if not ax.get_title():
            continue  # an empty panel of the grid
        [scenario] = [name for name, title in titles.items() if title == ax.get_title()]
        points: dict[tuple[float, float], set[str]] = {}
        for c in (c for c in cells if c["scenario"] == scenario):
            xy = (100 * c["calls_cut_share"], c["speedup_over_sync"])
            points.setdefault(xy, set()).add(c["policy"])
        labels = {tuple(t.xy): set(t.get_text().split("\n")) for t in ax.texts}
        assert len(labels) == len(ax.texts) and labels == points
        shared += sum(len(names) > 1 for names in points.values())
    assert shared  # the run has such points: the test tests something
