"""`toolenv rollout run` and `study` as a user meets them: what it refuses up front and what it leaves in --out."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rollout_client.cli import run_driver
from rollout_client.clock import run_virtual
from rollout_client.engines.eventsim import EventSimEngine
from rollout_client.report import PLOTS as RUN_PLOTS
from rollout_client.session import run_rollout
from rollout_client.settings import RolloutSettings
from rollout_client.study_report import PLOTS as STUDY_PLOTS
from rollout_client.workloads.plan import MAX_CONTEXT_TOKENS, TrajectoryPlan, TurnPlan
from toolenv.cli import build_app
from toolenv_core.latency.profile import shipped_profile_path

REPO_ROOT = Path(__file__).resolve().parents[2]


def rollout_run(polytrace_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    cmd = [
        sys.executable, "-m", "toolenv", "rollout", "run", "--engine", "sim", "--clock",
        "virtual", "--exact", "--trace", str(trace), "--out", str(out), *args,
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def test_a_length_scale_past_what_a_trajectory_holds_is_refused_before_the_run(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """--length-scale 1e9 died in a MemoryError (a traceback, exit 1) building the first prompt's
    token list; a scale whose trajectories fit still runs."""
    small = ("--limit", "2", "--batch", "2", "--no-plots")
    done = rollout_run(polytrace_dir, tmp_path / "big", *small, "--length-scale", "1e9")
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: trajectory ") and "Traceback" not in done.stderr
    assert f"a trajectory holds at most {MAX_CONTEXT_TOKENS:,}" in line
    assert "lower --length-scale" in line
    assert not (tmp_path / "big").exists()
    done = rollout_run(polytrace_dir, tmp_path / "fits", *small, "--length-scale", "20", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["summary"]["completed"] == 2


def test_no_plots_into_an_earlier_runs_directory_leaves_no_plot_of_that_run(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """The earlier run's PNGs stayed beside the new report.json, describing another run."""
    small = ("--limit", "4", "--batch", "4")
    assert rollout_run(polytrace_dir, tmp_path, *small).returncode == 0
    assert {p.name for p in tmp_path.glob("*.png")} == set(RUN_PLOTS)
    done = rollout_run(polytrace_dir, tmp_path, *small, "--policy", "sync", "--no-plots")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json", "trajectories.jsonl"]
    assert json.loads((tmp_path / "report.json").read_text())["policy"] == "sync"


def test_report_json_holds_the_notes_json_prints(polytrace_dir: Path, tmp_path: Path) -> None:
    """`--json` printed the run's notes (a selection short of its steps, a CPU-starved
    simulator), but report.json, written before them, had none: read later, it did not say."""
    done = rollout_run(polytrace_dir, tmp_path, "--limit", "2", "--batch", "2", "--steps", "2")
    assert done.returncode == 0, done.stderr
    notes = json.loads((tmp_path / "report.json").read_text())["notes"]
    assert len(notes) == 1 and notes[0].startswith("note: 2 trajectories selected"), notes
    assert notes[0] in done.stderr
    done = rollout_run(
        polytrace_dir, tmp_path, "--limit", "2", "--batch", "2", "--steps", "2", "--json"
    )
    assert json.loads(done.stdout) == json.loads((tmp_path / "report.json").read_text())


def test_a_report_the_disk_cannot_hold_leaves_the_earlier_run_whole(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """On a disk that filled (a file-size limit here), trajectories.jsonl was cut short beside the
    earlier run's report.json, and the run ended in an OSError traceback."""
    small = ("--limit", "4", "--batch", "4", "--no-plots")
    assert rollout_run(polytrace_dir, tmp_path, *small).returncode == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    limit = len(before["trajectories.jsonl"]) // 2

    def file_size_limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    cmd = [
        sys.executable, "-m", "toolenv", "rollout", "run", "--engine", "sim", "--clock",
        "virtual", "--exact", "--trace", str(trace), "--out", str(tmp_path), *small,
        "--policy", "sync",
    ]  # fmt: skip
    done = subprocess.run(
        cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, preexec_fn=file_size_limit
    )
    assert done.returncode == 2, done.stderr
    said = (
        f"error: --out {tmp_path}: cannot write {tmp_path / 'trajectories.jsonl'}: File too large"
    )
    assert said in done.stderr and "Traceback" not in done.stderr
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_step_the_selection_leaves_short_ends_its_bar_full(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """3 trajectories in steps of 2: the second step ran its one and its bar ended at `1/2`, as
    if a trajectory were left unfinished (the report said 1 launched, 1 completed)."""
    done = rollout_run(polytrace_dir, tmp_path, "--limit", "3", "--batch", "2", "--steps", "3")
    assert done.returncode == 0, done.stderr
    bars = [line.split() for line in done.stderr.splitlines() if line.startswith("step ")]
    assert [(bar[1], bar[3]) for bar in bars] == [("0", "2/2"), ("1", "1/1")], done.stderr
    steps = json.loads((tmp_path / "report.json").read_text())["steps"]
    assert [(s["launched"], s["completed"]) for s in steps] == [(2, 2), (1, 1)]


def test_study_no_plots_into_an_earlier_studys_directory_leaves_no_plot_of_that_study(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """The report is staged, then renamed in: the earlier study's PNGs were left beside it."""
    for name in STUDY_PLOTS:  # what the earlier study drew (drawing them takes seconds)
        (tmp_path / name).write_bytes(b"\x89PNG of the earlier study")
    (tmp_path / "notes.png").write_bytes(b"\x89PNG of the user's own")
    cmd = [
        sys.executable, "-m", "toolenv", "rollout", "study", "--quick", "--steps", "1",
        "--batch", "16", "--trace", str(polytrace_dir / "search_r1"), "--out", str(tmp_path),
        "--no-plots",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.png", "study.json", "study.md"]


def test_counts_of_one_read_in_the_singular(polytrace_dir: Path, tmp_path: Path) -> None:
    """The run said "1 trajectories selected ... for 1 step(s)" and "1 trajectories in", the
    study "1 steps of 1 trajectories per cell"."""
    done = rollout_run(
        polytrace_dir, tmp_path / "run", "--limit", "1", "--batch", "2", "--no-plots"
    )
    assert done.returncode == 0, done.stderr
    assert (
        "note: 1 trajectory selected (trace size, --limit, --sample) for 1 step of" in done.stderr
    )
    assert "\n1 trajectory in " in done.stdout
    cmd = [
        sys.executable, "-m", "toolenv", "rollout", "study", "--quick", "--steps", "1",
        "--batch", "1", "--trace", str(polytrace_dir / "search_r1"), "--out", str(tmp_path / "s"),
        "--no-plots",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "1 step of 1 trajectory per cell" in (tmp_path / "s" / "study.md").read_text()


@pytest.mark.parametrize("output", [(), ("--json",)], ids=["table", "json"])
def test_the_simulator_lag_note_is_printed_with_json_too(
    output: tuple[str, ...], polytrace_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A starved simulator's figures are bent (at --time-scale 1000 a 131 s step read 4,395 s);
    only the table said so: `--json`, what a script reads, said nothing."""
    real = run_driver.run_rollout

    async def starved(*args, **kwargs) -> dict:  # the CPU falling behind, without starving it
        report = await real(*args, **kwargs)
        report["sim_lag_s"] = 10 * report["summary"]["total_makespan_s"]
        return report

    monkeypatch.setattr(run_driver, "run_rollout", starved)
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    args = ["rollout", "run", "--engine", "sim", "--clock", "virtual", "--exact", "--trace"]
    args += [str(trace), "--limit", "2", "--batch", "2", "--no-plots", "--out", str(tmp_path)]
    result = CliRunner().invoke(build_app(), [*args, *output])
    assert result.exit_code == 0, result.stderr
    assert "behind its cost model (CPU starved); lower --time-scale" in result.stderr
    if output:
        assert json.loads(result.stdout)["sim_lag_s"] > 0  # stdout is still the report alone


def test_an_option_the_run_ignores_is_noted(polytrace_dir: Path, tmp_path: Path) -> None:
    """`--tool-timeout 0.5` under the default `async` ran with no deadline at all, and
    `--time-scale 20` on the virtual clock did nothing, both silently."""
    small = ("--limit", "2", "--batch", "2", "--no-plots", "--json")
    ignored = ("--tool-timeout", "0.5", "--unfinished", "abort", "--hedge-quantile", "0.5")
    done = rollout_run(polytrace_dir, tmp_path / "a", *small, *ignored, "--time-scale", "20")
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stderr.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: --tool-timeout has no effect: --policy async has no timeout part "
        "(e.g. --policy async+timeout)",
        "note: --unfinished has no effect: --policy async has no overlap part "
        "(e.g. --policy async+overlap)",
        "note: --hedge-quantile has no effect: --policy async has no hedge part "
        "(e.g. --policy async+hedge)",
        "note: --time-scale has no effect here (--clock virtual never sleeps): it compresses "
        "--engine sim on the wall clock",
    ]
    assert json.loads(done.stdout)["steps"][0]["tool_timeouts"] == 0
    # each option with its part: nothing to note
    policy = ("--policy", "async+timeout+overlap+hedge", "--steps", "1")
    done = rollout_run(polytrace_dir, tmp_path / "b", *small, *ignored, *policy)
    assert done.returncode == 0, done.stderr
    assert "has no effect" not in done.stderr


def test_an_option_of_another_workload_is_noted(polytrace_dir: Path, tmp_path: Path) -> None:
    """`--sample 0.1 --synthetic` drew every trajectory and `--max-turns 1 --trace` replayed
    every turn, silently: each shapes one workload only."""
    params = polytrace_dir / "intern_s1" / "enhanced_task_distribution_parameters.json"
    profile = "search_default"  # a shipped profile by name: there is no such file here
    args = ["rollout", "run", "--engine", "sim", "--clock", "virtual", "--synthetic", str(params)]
    args += ["--tool-profile", f"search={profile}", "--batch", "2", "--no-plots", "--json"]
    args += ["--out", str(tmp_path), "--sample", "0.1", "--max-turns", "1", "--length-scale", "0.5"]
    result = CliRunner().invoke(build_app(), args)
    assert result.exit_code == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: --sample has no effect with --synthetic: it shapes --trace",
        "note: --max-turns has no effect with --synthetic: it shapes --live",
    ]
    assert json.loads(result.stdout)["steps"][0]["launched"] == 2


def test_a_tool_profile_given_twice_for_one_tool_is_refused(tmp_path: Path) -> None:
    """`--tool-profile search=A --tool-profile search=B` ran with B alone, saying nothing of A."""
    a, b = shipped_profile_path("search_default"), tmp_path / "b.yaml"
    b.write_text(a.read_text())
    args = ["rollout", "run", "--engine", "sim", "--clock", "virtual", "--trace", str(tmp_path)]
    args += ["--tool-profile", f"search={a}", "--tool-profile", f"search={b}"]
    result = CliRunner().invoke(build_app(), [*args, "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    said = "".join(result.stderr.replace("│", "").split())  # typer's box, unwrapped
    expected = f"--tool-profile names 'search' twice ({a} and {b}): one file per tool"
    assert "".join(expected.split()) in said
    assert not (tmp_path / "o").exists()


def test_an_overlap_ratio_past_its_bound_is_bad_input(polytrace_dir: Path, tmp_path: Path) -> None:
    """`--overlap-ratio 1e308` overflowed the launch count, N * (1 + ratio): an OverflowError
    traceback, exit 1. 100 (101 N launched a step) is the most, and still runs."""
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    args = ["rollout", "run", "--engine", "sim", "--clock", "virtual", "--exact", "--trace"]
    args += [str(trace), "--limit", "2", "--batch", "1", "--policy", "async+overlap"]
    for ratio, code in (("1e308", 2), ("100.5", 2), ("100", 0)):
        out = tmp_path / ratio
        result = CliRunner().invoke(
            build_app(), [*args, "--overlap-ratio", ratio, "--no-plots", "--out", str(out)]
        )
        assert result.exit_code == code, (ratio, result.output, result.exception)
        if code:
            assert result.stderr == (
                "error: overlap_ratio: Input should be less than or equal to 100\n"
            )
            assert not out.exists()


def test_a_length_scale_past_the_float_range_is_refused_as_too_long(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """--length-scale 1e308 (and `calibrate --check-length-scale 1e308`) made infinite lengths:
    an OverflowError traceback where 1e9 was refused as a trajectory too long to hold."""
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    run = ["rollout", "run", "--engine", "sim", "--clock", "virtual", "--exact", "--trace"]
    run += [str(trace), "--limit", "2", "--length-scale", "1e308", "--out", str(tmp_path / "o")]
    calibrate = ["rollout", "calibrate", "--engine", "openai", "--openai-url"]
    calibrate += ["http://127.0.0.1:1", "--check", str(trace), "--check-length-scale", "1e308"]
    for args, lower in ((run, "lower --length-scale"), (calibrate, "lower --check-length-scale")):
        result = CliRunner().invoke(build_app(), args)
        assert result.exit_code == 2, (result.output, result.exception)
        [line] = result.stderr.splitlines()
        assert line.startswith("error: trajectory ") and lower in line
        assert f"a trajectory holds at most {MAX_CONTEXT_TOKENS:,}" in line


def test_the_simulator_lag_note_says_how_far_behind_in_modelled_seconds() -> None:
    """At --time-scale 20 a 0.042 s lag in a 0.8 s run (16 s modelled) is 5%, past the note's
    threshold, and the note read "fell 0.0 s behind its cost model": a lag of nothing."""
    report = {"summary": {"total_makespan_s": 16.0}, "time_scale": 20.0, "sim_lag_s": 0.042}
    assert run_driver.lag_note(report) == (
        "note: the simulator fell 0.042 s (0.84 s modelled, 5% of the run) behind its cost model "
        "(CPU starved); lower --time-scale for faithful timings"
    )
    assert run_driver.lag_note({**report, "sim_lag_s": 0.039}) is None


def test_an_option_refused_when_the_run_starts_is_the_one_line_on_stderr(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """Options checked as the rollout starts (here --tool-scale on the wall clock; a gateway
    down, a tool profile that does not read alike) were refused under a progress bar already
    begun, whose end put an empty line before the error."""
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    args = ["rollout", "run", "--engine", "sim", "--exact", "--trace", str(trace), "--limit", "2"]
    result = CliRunner().invoke(
        build_app(), [*args, "--tool-scale", "2", "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr.startswith("error: --tool-profile and --tool-scale shape the in-process")
    assert result.stderr.count("\n") == 1


def test_a_trace_named_in_the_cache_of_the_config_file_given_is_found(
    polytrace_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--config FILE` with `traces: {cache_dir: DIR}`: the name was looked up in the default
    cache (that section was read from TOOLENV_CONFIG's file alone) while `config show --config
    FILE` said DIR was in force."""
    monkeypatch.delenv("TOOLENV_CONFIG", raising=False)
    monkeypatch.delenv("TOOLENV_TRACES_CACHE_DIR", raising=False)
    cache = tmp_path / "cache"
    (cache / "search_r1").mkdir(parents=True)
    name = "search_r1/multiturn_workload_step_0.jsonl"
    (cache / name).symlink_to(polytrace_dir / name)
    config = tmp_path / "toolenv.yaml"
    config.write_text(f"traces:\n  cache_dir: {cache}\n")
    args = ["rollout", "run", "--engine", "sim", "--clock", "virtual", "--exact", "--limit", "2",
            "--batch", "2", "--no-plots", "--out", str(tmp_path / "out"), "--config", str(config)]  # fmt: skip
    done = CliRunner().invoke(build_app(), [*args, "--trace", name])
    assert done.exit_code == 0, done.output
    done = CliRunner().invoke(build_app(), [*args, "--trace", "search_r1/nope.jsonl"])
    assert done.exit_code == 2 and f"nor in the trace cache {cache};" in done.stderr, done.output


def test_a_steps_wall_time_leaves_out_the_engines_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 0's "wall time (s)" counted the engine's start: vLLM's 35 s beside a makespan of
    1.4 s in the table of `docs/cli.md`'s vllm example."""

    async def slow_start(self: EventSimEngine) -> None:
        time.sleep(1.0)  # an engine that takes a real second to start

    monkeypatch.setattr(EventSimEngine, "start", slow_start)
    settings = RolloutSettings(engine="sim", clock="virtual", exact=True, batch=1, steps=1)
    plan = TrajectoryPlan("t", 64, [TurnPlan(8, [], "stop")])
    report = run_virtual(run_rollout(settings, iter([plan])))
    [step_wall] = report["wall"]["steps_s"]
    assert step_wall < 0.5 <= 1.0 <= report["wall"]["elapsed_s"]
