"""`toolenv rollout validate`: the simulator against PolyTrace's own recorded timings."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import matplotlib.figure
import matplotlib.pyplot
import pytest
from rollout_support import endless_cost_profile
from typer.testing import CliRunner

from rollout_client.cli import app
from rollout_client.clock import run_virtual
from rollout_client.engines.costmodel import BUILTIN_PROFILES
from rollout_client.engines.eventsim import EventSimEngine
from rollout_client.session import run_rollout
from rollout_client.settings import RolloutSettings
from rollout_client.validate import fit_cost_model, plot_step, recorded_timings, validate_step
from rollout_client.workloads.replay import plan_from_record
from toolenv.cli import build_app
from toolenv_core.polytrace import read_multiturn

REPO_ROOT = Path(__file__).resolve().parents[2]
toolenv_app = build_app()


def _step(polytrace_dir: Path, n: int, limit: int | None = None) -> list:
    path = polytrace_dir / "search_r1" / f"multiturn_workload_step_{n}.jsonl"
    return list(itertools.islice(read_multiturn(path), limit))


def test_recorded_completion_is_summed_engine_and_tool_time(polytrace_dir: Path) -> None:
    [record] = _step(polytrace_dir, 2, 1)
    completion, turns = recorded_timings([record])
    want = sum(t.engine_latency_s for t in record.turns) + sum(
        c.latency_s for c in record.tool_calls
    )
    assert completion[0] == pytest.approx(want)
    assert len(turns) == len(record.turns)


def test_fit_recovers_the_engine_that_made_a_trace(polytrace_dir: Path) -> None:
    """Record a step with a known engine model, then fit a wrong one back to it."""
    truth = BUILTIN_PROFILES["searchr1-qwen7b"].model_copy(
        update={"max_batch": 128, "decode_per_seq_s": 0.0008}
    )
    plans = [plan_from_record(r, i, exact=True) for i, r in enumerate(_step(polytrace_dir, 0, 200))]
    settings = RolloutSettings(engine="sim", clock="virtual", batch=len(plans), exact=True)
    report = run_virtual(run_rollout(settings, iter(plans), engine=EventSimEngine(truth)))
    order = {p.trajectory_id: i for i, p in enumerate(plans)}  # records come in completion order
    made = sorted(report["_records"], key=lambda r: order[r.trajectory_id])
    assert validate_step(made, truth)["makespan_accuracy"] == pytest.approx(1.0, abs=1e-3)
    wrong = truth.model_copy(update={"decode_per_seq_s": 0.0032, "max_batch": 2048})
    assert validate_step(made, wrong)["makespan_accuracy"] < 0.9
    fitted, _ = fit_cost_model([made], wrong)
    result = validate_step(made, fitted)
    assert result["makespan_accuracy"] > 0.97 and result["completion_ks"] < 0.1
    assert fitted.decode_per_seq_s == pytest.approx(0.0008, rel=0.5)


def test_a_step_the_model_itself_recorded_replays_with_a_ks_of_0(polytrace_dir: Path) -> None:
    """The simulated completion times come from the report at 0.1 ms, the recorded ones at full
    precision: 4 trajectories equal to 2 us read KS 0.25 (one of four 'different'), over the
    0.1 target, for a step that replays exactly."""
    cost = BUILTIN_PROFILES["searchr1-qwen7b"]
    plans = [plan_from_record(r, i, exact=True) for i, r in enumerate(_step(polytrace_dir, 0, 4))]
    settings = RolloutSettings(engine="sim", clock="virtual", batch=len(plans), exact=True)
    report = run_virtual(run_rollout(settings, iter(plans), engine=EventSimEngine(cost)))
    order = {p.trajectory_id: i for i, p in enumerate(plans)}
    made = sorted(report["_records"], key=lambda r: order[r.trajectory_id])
    result = validate_step(made, cost)
    assert result["makespan_accuracy"] == 1.0
    assert result["completion_ks"] == 0.0 and result["completion_w1_rel"] == 0.0


def test_builtin_profile_matches_a_step_it_was_not_fitted_on(polytrace_dir: Path) -> None:
    step2 = polytrace_dir / "search_r1" / "multiturn_workload_step_2.jsonl"
    cmd = [sys.executable, "-m", "toolenv", "rollout", "validate", "--trace", str(step2), "--json"]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    [result] = json.loads(done.stdout)["steps"]
    assert result["trajectories"] == 2048
    assert result["makespan_accuracy"] >= 0.95  # PolyTrace's own replay: 94.7%
    assert result["completion_ks"] <= 0.1  # the target; deterministic in virtual time


def test_validate_refuses_to_report_on_a_fitted_step(polytrace_dir: Path) -> None:
    step = str(polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl")
    cmd = [sys.executable, "-m", "toolenv", "rollout", "validate", "--trace", step, "--fit", step]
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "never fit on what you report" in done.stderr


def test_validate_checks_its_outputs_before_the_work(polytrace_dir: Path, tmp_path: Path) -> None:
    """A --save-profile that is a directory was found after minutes of fitting, as a bare
    "[Errno 21] Is a directory"; without --fit it was silently never written."""

    step0, step2 = (
        str(polytrace_dir / "search_r1" / f"multiturn_workload_step_{n}.jsonl") for n in (0, 2)
    )
    a_file = tmp_path / "f.txt"
    a_file.write_text("")
    cases = [
        (["--fit", step0, "--save-profile", str(tmp_path)], f"--save-profile {tmp_path}: is a directory"),
        (["--save-profile", str(tmp_path / "p.json")], "add --fit"),
        (["--plot-dir", str(a_file)], f"--plot-dir {a_file}: is a file"),
        (
            ["--plot-dir", str(a_file / "plots")],
            f"--plot-dir {a_file / 'plots'}: {a_file} is a file, not a directory",
        ),
    ]  # fmt: skip
    for args, message in cases:
        result = CliRunner().invoke(app, ["validate", "--trace", step2, *args])
        assert result.exit_code == 2, result.output
        assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr


def test_fit_on_the_reported_step_is_refused_however_it_is_named(
    polytrace_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--fit /abs/step.jsonl --trace step.jsonl` (or a link to it, or a copy of it) compared the
    paths as text and fitted on the very step it reported."""
    lines = (polytrace_dir / "search_r1" / "multiturn_workload_step_2.jsonl").open()
    step = tmp_path / "step_2.jsonl"
    step.write_text("".join(itertools.islice(lines, 4)))
    (tmp_path / "link.jsonl").symlink_to(step)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "copy.jsonl").write_bytes(step.read_bytes())  # the cache's and a clone's
    for fit in (str(step), "link.jsonl", "copy.jsonl"):
        result = CliRunner().invoke(app, ["validate", "--fit", fit, "--trace", "step_2.jsonl"])
        assert result.exit_code == 2, result.output
        assert result.stderr == (
            "error: --fit and --trace must be different steps (never fit on what you report)\n"
        )


def test_validate_an_empty_step_says_so(tmp_path: Path) -> None:

    empty = tmp_path / "step.jsonl"
    empty.write_text("")
    result = CliRunner().invoke(app, ["validate", "--trace", str(empty)])
    assert result.exit_code == 2  # it said "batch: Input should be greater than or equal to 1"
    assert result.stderr == f"error: {empty}: holds no trajectories\n"


def test_validate_table_gives_every_time_its_unit(polytrace_dir: Path, tmp_path: Path) -> None:

    lines = (polytrace_dir / "search_r1" / "multiturn_workload_step_2.jsonl").open()
    step = tmp_path / "step_2.jsonl"
    step.write_text("".join(itertools.islice(lines, 16)))
    result = CliRunner().invoke(app, ["validate", "--trace", str(step)])
    assert result.exit_code == 0, result.output
    # the turn latency columns had no unit, beside "makespan rec/sim (s)"
    assert "turn p50 rec/sim (s)" in result.stdout and "turn p90 rec/sim (s)" in result.stdout


def test_validate_table_names_each_step_in_full(polytrace_dir: Path, tmp_path: Path) -> None:
    """The step column was cut to `multiturn_workload_…` on every row: steps of one trace
    (`--trace search_r1`) could not be told apart."""
    source = (polytrace_dir / "search_r1" / "multiturn_workload_step_2.jsonl").open()
    names = [f"multiturn_workload_step_{n}.jsonl" for n in (0, 1)]
    for name in names:
        (tmp_path / name).write_text("".join(itertools.islice(source, 8)))
    result = CliRunner().invoke(app, ["validate", "--trace", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = [line.split("│")[1].strip() for line in result.stdout.splitlines() if "│" in line]
    assert "".join(rows) == "".join(names)  # each name whole, folded over lines if need be


def test_steps_of_one_file_name_get_a_row_and_a_plot_each(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """Two runs' `trajectories.jsonl` were two rows both named `trajectories.jsonl`, and one
    `validation-trajectories.png`: the second step's plot written over the first's."""
    source = (polytrace_dir / "search_r1" / "multiturn_workload_step_2.jsonl").open()
    steps = [tmp_path / run / "trajectories.jsonl" for run in ("run1", "run2")]
    for step in steps:
        step.parent.mkdir()
        step.write_text("".join(itertools.islice(source, 4)))
    args = ["validate", "--trace", str(steps[0]), "--trace", str(steps[1])]
    result = CliRunner().invoke(app, [*args, "--plot-dir", str(tmp_path / "plots")])
    assert result.exit_code == 0, result.output
    rows = [line.split("│")[1].strip() for line in result.stdout.splitlines() if "│" in line]
    assert "".join(rows) == "run1/trajectories.jsonlrun2/trajectories.jsonl"  # folded or not
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert plots == ["validation-run1-trajectories.png", "validation-run2-trajectories.png"]


def test_validate_a_step_without_timings_says_so(polytrace_dir: Path, tmp_path: Path) -> None:

    good = json.loads(
        (polytrace_dir / "search_r1" / "multiturn_workload_step_2.jsonl").open().readline()
    )
    no_turns = {**good, "turns": [], "tool_calls": []}
    untimed = {
        **good,
        "turns": [{**t, "engine_latency_s": 0} for t in good["turns"]],
        "tool_calls": [{**c, "latency_s": 0} for c in good["tool_calls"]],
    }
    for record, said in (  # each was a ZeroDivisionError traceback
        (no_turns, ":1: field 'turns': the trajectory has no turn"),  # refused by its reader
        (untimed, ": records no timings (engine_latency_s, latency_s): nothing to validate\n"),
    ):
        step = tmp_path / "step.jsonl"
        step.write_text(json.dumps(record) + "\n")
        result = CliRunner().invoke(app, ["validate", "--trace", str(step)])
        assert result.exit_code == 2, (result.output, result.exception)
        assert result.stderr.startswith(f"error: {step}{said}"), result.stderr
        assert result.stderr.count("\n") == 1


def test_validate_a_step_without_engine_latency_says_so(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """A gateway capture turned into a trace records tool calls, not the engine: validate read
    its turns' engine latency as 0 and reported the replay of tool latency alone as 99.9% accurate
    (a turn latency of 0.0 s recorded and simulated)."""
    capture, step = tmp_path / "capture.jsonl", tmp_path / "step.jsonl"
    calls = [("a", 0, 0.1), ("a", 1, 0.2), ("b", 0, 0.3)]
    capture.write_text(
        "".join(
            json.dumps({"tool_name": "search", "turn": turn, "latency_s": latency})[:-1]
            + f', "trajectory_id": "{tid}", "step": 0}}\n'
            for tid, turn, latency in calls
        )
    )
    converted = CliRunner().invoke(
        toolenv_app, ["gateway", "trace-to-multiturn", str(capture), str(step)]
    )
    assert converted.exit_code == 0, converted.output
    result = CliRunner().invoke(app, ["validate", "--trace", str(step)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr.startswith(f"error: {step}:1: field 'turns.0.engine_latency_s': "), (
        result.stderr
    )
    assert "3 of 3 turns" in result.stderr and "trace-to-multiturn" in result.stderr
    assert result.stderr.count("\n") == 1
    # a recorded step with one turn's engine latency missing: that turn named, on its own line
    lines = (polytrace_dir / "search_r1" / "multiturn_workload_step_2.jsonl").open()
    records = [json.loads(line) for line in itertools.islice(lines, 3)]
    del records[2]["turns"][1]["engine_latency_s"]
    step.write_text("\n" + "".join(json.dumps(r) + "\n" for r in records))
    result = CliRunner().invoke(app, ["validate", "--trace", str(step)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr.startswith(f"error: {step}:4: field 'turns.1.engine_latency_s': ")
    assert "1 of " in result.stderr


def test_validate_a_capture_of_several_steps_says_first_it_lacks_engine_latency(
    tmp_path: Path,
) -> None:
    """A capture of a two-step run said "split the file by step"; split, each step was refused
    for what it could never give: the engine latency."""
    capture, trace = tmp_path / "capture.jsonl", tmp_path / "trace.jsonl"
    call = {"tool_name": "search", "turn": 0, "latency_s": 0.1, "trajectory_id": "a"}
    capture.write_text("".join(json.dumps({**call, "step": n}) + "\n" for n in (0, 1)))
    args = ["gateway", "trace-to-multiturn", str(capture), str(trace)]
    assert CliRunner().invoke(toolenv_app, args).exit_code == 0
    result = CliRunner().invoke(app, ["validate", "--trace", str(trace)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr.startswith(f"error: {trace}:1: field 'turns.0.engine_latency_s': ")


def test_validate_a_file_of_several_steps_says_so(polytrace_dir: Path, tmp_path: Path) -> None:
    """A run's own trajectories.jsonl (--steps 2) replayed both steps' trajectories as one step
    launched at once: twice the load the recording saw, compared with it as if it were one."""
    lines = (polytrace_dir / "search_r1" / "multiturn_workload_step_2.jsonl").open()
    records = [json.loads(line) for line in itertools.islice(lines, 4)]
    records[3]["step"] = 3
    step = tmp_path / "steps.jsonl"
    step.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = CliRunner().invoke(app, ["validate", "--trace", str(step)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr == (
        f"error: {step}:4: field 'step': 3, where line 1 is of step 2: validate replays one "
        "recorded step a file (split the file by step)\n"
    )


def test_validate_a_cost_profile_whose_iterations_never_end_is_bad_input(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """Iterations of 1e308 s passed the virtual clock's horizon: a VirtualTimeDeadlock traceback."""
    profile = endless_cost_profile(tmp_path / "cost.json")
    lines = (polytrace_dir / "search_r1" / "multiturn_workload_step_2.jsonl").open()
    step = tmp_path / "step_2.jsonl"
    step.write_text("".join(itertools.islice(lines, 4)))
    result = CliRunner().invoke(
        app, ["validate", "--trace", str(step), "--cost-profile", str(profile)]
    )
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr.startswith("error: virtual time passed")


def test_a_saved_fit_names_itself_and_its_own_error(polytrace_dir: Path, tmp_path: Path) -> None:
    """The fitted profile kept the starting profile's name and fit_error: a fit on 16 trajectories
    was saved as `searchr1-qwen7b` with "step2_makespan_accuracy": 0.9973, the built-in's."""
    steps = []
    for n in (0, 1, 2):
        lines = (polytrace_dir / "search_r1" / f"multiturn_workload_step_{n}.jsonl").open()
        steps.append(tmp_path / f"step_{n}.jsonl")
        steps[-1].write_text("".join(itertools.islice(lines, 16)))
    saved = tmp_path / "fitted.json"
    args = ["validate", "--fit", str(steps[0]), "--fit", str(steps[1]), "--trace", str(steps[2])]
    result = CliRunner().invoke(app, [*args, "--save-profile", str(saved), "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads(result.stdout)
    profile = json.loads(saved.read_text())
    assert profile["name"] == report["cost_profile"] == "fitted"
    assert profile["fit_error"] == {"fit_loss": report["fit"]["loss"]}


def test_a_save_profile_that_cannot_be_written_is_refused_before_the_fit(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """A --save-profile whose name is too long (or on a read-only file system) was found after
    the fit (minutes on full steps), as a bare "[Errno 36] File name too long: ..."."""
    steps = []
    for n in (0, 2):
        lines = (polytrace_dir / "search_r1" / f"multiturn_workload_step_{n}.jsonl").open()
        steps.append(tmp_path / f"step_{n}.jsonl")
        steps[-1].write_text("".join(itertools.islice(lines, 8)))
    saved = tmp_path / ("p" * 300 + ".json")
    args = ["validate", "--fit", str(steps[0]), "--trace", str(steps[1])]
    result = CliRunner().invoke(app, [*args, "--save-profile", str(saved)])
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr == f"error: --save-profile {saved}: cannot write: File name too long\n"
    plots = tmp_path / ("d" * 300)  # the same for --plot-dir: a traceback in exists()
    result = CliRunner().invoke(
        app, ["validate", "--trace", str(steps[1]), "--plot-dir", str(plots)]
    )
    assert result.exit_code == 2, (result.output, result.exception)
    assert (
        result.stderr
        == f"error: --plot-dir {plots}: cannot make the directory: File name too long\n"
    )
    # a name that can be written is not left behind by the check when the run fails later
    other = tmp_path / "fitted.json"
    args = ["validate", "--fit", str(steps[0]), "--trace", str(tmp_path / "nowhere.jsonl")]
    result = CliRunner().invoke(app, [*args, "--save-profile", str(other)])
    assert result.exit_code == 2 and not other.exists(), result.output


def test_validate_plot_draws_a_step_of_one_trajectory(
    polytrace_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The completion CDFs were lines through the sorted points: a step of one trajectory (one
    point each) left the panel empty under its legend."""
    drawn: list[matplotlib.figure.Figure] = []
    monkeypatch.setattr(matplotlib.pyplot, "close", drawn.append)
    records = _step(polytrace_dir, 0, 1)
    result = plot_step(records, BUILTIN_PROFILES["searchr1-qwen7b"], tmp_path / "v.png", "one")
    [fig] = drawn
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    for name, key in (("recorded", "makespan_recorded_s"), ("simulated", "makespan_simulated_s")):
        assert set(lines[name].get_ydata()) == {0.0, 1.0}
        assert max(lines[name].get_xdata()) == pytest.approx(result[key], abs=0.01)


def test_save_profile_onto_a_step_it_fits_is_refused(polytrace_dir: Path, tmp_path: Path) -> None:
    """`--fit S --save-profile S` wrote the fitted cost profile over the recorded step, exit 0."""
    source = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    fit_step, report_step = tmp_path / "fit.jsonl", tmp_path / "report.jsonl"
    lines = source.open().readlines()
    fit_step.write_text("".join(lines[:4]))
    report_step.write_text("".join(lines[4:8]))
    before = fit_step.read_bytes()
    args = ["validate", "--trace", str(report_step), "--fit", str(fit_step)]
    result = CliRunner().invoke(app, [*args, "--save-profile", str(fit_step)])
    assert result.exit_code == 2, result.output
    said = f"error: --save-profile {fit_step}: is the step {fit_step} it fits; name another file"
    assert result.stderr == said + "\n"
    assert fit_step.read_bytes() == before
