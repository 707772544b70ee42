"""Virtual time: the in-process tools (deadlines, hangs, hedging, backpressure, profiles) and
`toolenv rollout run --clock virtual` end to end (determinism, refusals, reports).

The engine model's own tests are in test_virtual_engine.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image as plt_image
import numpy as np
import pytest
from testkit import free_port
from typer.testing import CliRunner

from rollout_client.clock import now, run_virtual
from rollout_client.gateway_client import CLIENT_TIMEOUT_S, ToolOutcome
from rollout_client.session import run_rollout
from rollout_client.settings import RolloutSettings
from rollout_client.simtools import SimTools, ToolModel
from rollout_client.workloads.plan import ToolCallPlan, TrajectoryPlan, TurnPlan
from toolenv.cli import build_app
from toolenv_core.deadline import Deadline
from toolenv_core.hedging import LatencyWindow
from toolenv_core.latency import HangFault, ThrottleFault
from toolenv_core.latency.profile import shipped_profile_path


def test_sim_tools_deadline_hang_and_hedging() -> None:
    async def main() -> dict:
        tools = SimTools({}, default=ToolModel(faults=[HangFault(rate=1.0)]), seed=1)
        hung = await tools.call("search", {"delay_s": 0.2}, deadline=Deadline(now() + 2.0))
        slow = SimTools({}, default=ToolModel(), seed=1)
        late = await slow.call("search", {"delay_s": 5.0}, deadline=Deadline(now() + 1.5))
        quick = await slow.call("search", {"delay_s": 0.3}, deadline=Deadline(now() + 1.5))
        # Hedging: after 20 fast calls the p50 is 0.1 s; a slow call gets a second attempt.
        hedged = SimTools(
            {}, default=ToolModel(), seed=1, hedge=lambda: LatencyWindow(0.5, min_samples=20)
        )
        for i in range(20):
            await hedged.call("search", {"delay_s": 0.1, "query": str(i)})
        started = now()
        outcome = await hedged.call("search", {"delay_s": 9.0, "query": "x"})
        return {
            "hung": (hung.status, hung.elapsed_s),
            "late": (late.status, late.elapsed_s),
            "quick": (quick.status, quick.elapsed_s),
            "hedged": (outcome.status, now() - started, hedged.stats.hedges),
        }

    got = run_virtual(main())
    assert got["hung"] == ("timeout", pytest.approx(2.0))
    assert got["late"] == ("timeout", pytest.approx(1.5))
    assert got["quick"] == ("ok", pytest.approx(0.3))
    status, elapsed, hedges = got["hedged"]
    # The hedge (same recorded latency in exact mode) cannot win; it is sent and counted once.
    assert (status, hedges) == ("ok", 1) and elapsed == pytest.approx(9.0)


def test_sim_tools_wait_out_backpressure_no_longer_than_the_client_would() -> None:
    """A tool that throttles every call was retried for ever without a deadline: the virtual
    clock stepped 2 s at a time and the run never ended. `GatewayClient` gives up at its own
    timeout; so do the simulated tools, and under a deadline at the deadline."""

    async def main() -> tuple[ToolOutcome, ToolOutcome]:
        throttled = ToolModel(faults=[ThrottleFault(rate=1.0, retry_after_s=2.0)])
        tools = SimTools({}, default=throttled, seed=1)
        free = await asyncio.wait_for(tools.call("search", {"delay_s": 0.1}), timeout=3600)
        bounded = await tools.call("search", {"delay_s": 0.1}, deadline=Deadline(now() + 5.0))
        return free, bounded

    free, bounded = run_virtual(main())
    assert free.status == "timeout" and free.http_status == 429
    assert free.error == f"backpressure past the client's {CLIENT_TIMEOUT_S:g} s timeout"
    assert CLIENT_TIMEOUT_S - 2.0 <= free.elapsed_s < CLIENT_TIMEOUT_S
    assert (bounded.status, bounded.error) == ("timeout", "backpressure past the deadline")
    assert bounded.elapsed_s < 5.0


def test_sim_tools_draw_from_a_profile_with_common_random_numbers() -> None:
    from toolenv_core.latency import LogNormal

    sampler = LogNormal(median_s=0.2, sigma=1.0).build()

    async def main(seed: int) -> list[float]:
        tools = SimTools({"search": ToolModel(sampler, scale=10.0)}, seed=seed)
        out = []
        for i in range(200):
            o = await tools.call("search", {"query": f"q{i}"}, trajectory_id="t")
            out.append(o.elapsed_s)
        return out

    a, b, c = run_virtual(main(0)), run_virtual(main(0)), run_virtual(main(1))
    assert a == b and a != c
    assert float(np.median(a)) == pytest.approx(2.0, rel=0.25)  # the x10 scale applies


REPO_ROOT = Path(__file__).resolve().parents[2]


def _run_cli(polytrace_dir: Path, out: Path, *extra: str) -> dict:
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    cmd = [
        sys.executable, "-m", "toolenv", "rollout", "run", "--engine", "sim", "--clock",
        "virtual", "--trace", str(trace), "--exact", "--batch", "128", "--limit", "400",
        "--steps", "2", "--out", str(out), "--json", "--no-plots", *extra,
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    report.pop("wall")
    report["settings"].pop("out_dir")
    return report


def test_virtual_run_is_deterministic_for_a_seed(polytrace_dir: Path, tmp_path: Path) -> None:
    policy = ("--policy", "async+timeout+overlap", "--tool-timeout", "1.0")
    first = _run_cli(polytrace_dir, tmp_path / "a", *policy)
    second = _run_cli(polytrace_dir, tmp_path / "b", *policy)
    assert json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)
    assert (tmp_path / "a" / "trajectories.jsonl").read_bytes() == (
        tmp_path / "b" / "trajectories.jsonl"
    ).read_bytes()
    assert first["clock"] == "virtual" and first["summary"]["completed"] == 256
    assert first["summary"]["tool_timeouts"] > 0  # recorded latencies over 1 s are cut
    # modelled minutes, not wall seconds: far more modelled time than the run took
    assert first["summary"]["total_makespan_s"] > 20


def test_virtual_run_draws_from_a_tool_profile_or_says_what_it_needs(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    base = [
        sys.executable, "-m", "toolenv", "rollout", "run", "--engine", "sim", "--clock",
        "virtual", "--trace", str(trace), "--batch", "32", "--limit", "32", "--json",
        "--no-plots", "--out", str(tmp_path),
    ]  # fmt: skip
    refused = subprocess.run(base, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "--tool-profile" in refused.stderr
    profile = shipped_profile_path("search_default")
    drawn = subprocess.run(
        [*base, "--tool-profile", f"search={profile}", "--tool-scale", "10"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert drawn.returncode == 0, drawn.stderr
    report = json.loads(drawn.stdout)
    assert report["summary"]["completed"] == 32 and report["tools"]["calls"] > 32


def test_a_misspelt_tool_profile_is_refused_before_the_run(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """A profile for a tool no trajectory calls: without --exact every call of the tool it was
    meant for would fail (15 of 16 trajectories did), so the run is refused up front; with
    --exact the recorded latencies serve and the unused profile is a note."""
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    profile = shipped_profile_path("search_default")
    base = [
        sys.executable, "-m", "toolenv", "rollout", "run", "--engine", "sim", "--clock",
        "virtual", "--trace", str(trace), "--batch", "16", "--limit", "16", "--json",
        "--no-plots", "--out", str(tmp_path), "--tool-profile", f"serch={profile}",
    ]  # fmt: skip
    refused = subprocess.run(base, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2, refused.stderr
    assert "no profile for search" in refused.stderr and "serch" in refused.stderr
    assert not (tmp_path / "report.json").exists()
    exact = subprocess.run(
        [*base, "--exact"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert exact.returncode == 0, exact.stderr
    assert "--tool-profile serch: no selected trajectory calls it" in exact.stderr
    assert json.loads(exact.stdout)["summary"]["completed"] == 16


def test_hedging_recorded_latencies_alone_is_noted(polytrace_dir: Path, tmp_path: Path) -> None:
    """`--exact --policy async+hedge` with no profile sent hedges that replay the call's own
    recorded latency: started later, none ever answered first, and nothing said so."""
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    profile = shipped_profile_path("search_default")
    base = [
        sys.executable, "-m", "toolenv", "rollout", "run", "--engine", "sim", "--clock",
        "virtual", "--trace", str(trace), "--batch", "256", "--limit", "256", "--json",
        "--no-plots", "--out", str(tmp_path), "--exact", "--policy", "async+hedge",
    ]  # fmt: skip
    runs = {
        name: subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        for name, cmd in (
            ("alone", base),
            ("drawn", [*base, "--tool-profile", f"search={profile}"]),
        )
    }
    assert all(run.returncode == 0 for run in runs.values()), runs
    alone = json.loads(runs["alone"].stdout)
    assert alone["tools"]["hedges"] > 0  # sent, and the step no shorter than without them
    assert (
        "note: +hedge on search: with no --tool-profile a hedge replays the call's own "
        "recorded latency" in runs["alone"].stderr
    )
    assert "+hedge on" not in runs["drawn"].stderr


def test_an_unbounded_tool_latency_ends_the_run_with_a_message(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """A profile whose draws overflow (lognormal sigma 1e6) and no timeout policy: exit 2 and
    one line saying what to change, within seconds (it spun for ever before)."""
    profile = tmp_path / "wide.yaml"
    profile.write_text("tool: search\nmodel: {kind: lognormal, median_s: 0.1, sigma: 1.0e+6}\n")
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    cmd = [
        sys.executable, "-m", "toolenv", "rollout", "run", "--engine", "sim", "--clock",
        "virtual", "--trace", str(trace), "--batch", "8", "--limit", "8", "--no-plots",
        "--out", str(tmp_path / "out"), "--tool-profile", f"search={profile}",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "never ends" in done.stderr and "max_s" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_output_directory_that_cannot_be_made_is_refused_before_the_run(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    long_name = tmp_path / ("d" * 300)  # too long for the file system: a traceback in exists()
    for command, out in itertools.product(
        (
            [
                "run",
                "--engine",
                "sim",
                "--clock",
                "virtual",
                "--exact",
                "--limit",
                "8",
                "--batch",
                "8",
            ],
            ["study", "--quick"],
        ),
        # under a file, or too long a name: it cannot be made; /proc: no file can be written there
        (blocker / "out", long_name, Path("/proc")),
    ):
        cmd = [sys.executable, "-m", "toolenv", "rollout", *command, "--trace", str(trace),
               "--out", str(out)]  # fmt: skip
        done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert f"error: --out {out}: " in done.stderr
        assert "Traceback" not in done.stderr and "study" not in done.stderr.split("error:")[0]


def test_reports_count_on_one_set_and_say_what_they_ran(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """Timeouts and calls over the same set; a selection below --batch is said; modelled seconds."""
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    cmd = [
        sys.executable, "-m", "toolenv", "rollout", "run", "--engine", "sim", "--clock",
        "virtual", "--trace", str(trace), "--exact", "--batch", "16", "--limit", "8",
        "--policy", "async+timeout", "--tool-timeout", "0.3", "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "8 trajectories selected" in done.stderr and "the first step runs 8" in done.stderr
    assert "/ 2048 (" in done.stdout  # in flight over capacity, with its scale
    assert "modelled" in done.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    [step] = report["steps"]
    # every timeout the tools answered is in the step's count, over the calls it counts
    assert step["tool_timeouts"] == report["tools"]["timeouts"] > 0
    assert step["tool_timeouts"] <= step["tool_calls"]
    assert (tmp_path / "makespan.png").stat().st_size > 0
    helped = subprocess.run(
        [sys.executable, "-m", "toolenv", "rollout", "run", "--help"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert "[default: (64)]" in helped.stdout and "[default: (async)]" in helped.stdout


def test_the_completion_cdf_of_one_trajectory_is_drawn(polytrace_dir: Path, tmp_path: Path) -> None:
    """A CDF that started at the first completion was a single point for one trajectory (or for
    a batch that all finished together): completion_cdf.png had empty axes."""
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    cmd = [
        sys.executable, "-m", "toolenv", "rollout", "run", "--engine", "sim", "--clock",
        "virtual", "--trace", str(trace), "--exact", "--batch", "1", "--limit", "1",
        "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rgb = plt_image.imread(tmp_path / "completion_cdf.png")[..., :3]
    blue = np.all(np.abs(rgb - np.array([31, 119, 180]) / 255) < 0.05, axis=-1)
    assert blue.sum() > 500  # the legend's sample alone is about 60 pixels


def test_run_help_shows_every_settings_default() -> None:
    """docs/cli.md: "Every option's default shows in `toolenv rollout run --help`"; --clock's
    (wall: real time, tools through a gateway) did not."""
    helped = subprocess.run(
        [sys.executable, "-m", "toolenv", "rollout", "run", "--help"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "300"},
    )  # fmt: skip
    clock = next(line for line in helped.stdout.splitlines() if "--clock" in line)
    assert "[default: (wall)]" in clock, clock


def test_the_table_says_which_steps_it_leaves_out(polytrace_dir: Path, tmp_path: Path) -> None:
    """The table shows six steps: an 8-step run printed steps 0-5 and, below them, "64
    trajectories in ..." over all eight, with nothing saying two steps were left out."""
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    cmd = [
        sys.executable, "-m", "toolenv", "rollout", "run", "--engine", "sim", "--clock",
        "virtual", "--trace", str(trace), "--exact", "--batch", "2", "--limit", "16",
        "--steps", "8", "--no-plots", "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(
        cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "step 5" in done.stdout and "step 6" not in done.stdout
    assert "steps 6-7 not shown (report.json has every step)" in done.stdout
    assert "16 trajectories in" in done.stdout


@pytest.mark.parametrize(
    "option", [["--tool-scale", "10"], ["--tool-profile", "search=profile.yaml"]]
)
def test_in_process_tool_options_on_the_wall_clock_are_refused(
    polytrace_dir: Path, tmp_path: Path, option: list[str]
) -> None:
    """On the wall clock the gateway's tools answer: --tool-scale 10 was ignored and the run
    reported tools at their usual speed (the hedge part is refused the same way)."""
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    cmd = [
        sys.executable, "-m", "toolenv", "rollout", "run", "--engine", "sim", "--gateway",
        f"http://127.0.0.1:{free_port()}", "--trace", str(trace), "--exact", "--limit", "2",
        "--batch", "2", "--out", str(tmp_path / "o"), *option,
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().startswith("error: --tool-profile and --tool-scale shape")
    assert not (tmp_path / "o").exists()


def test_live_alone_is_a_workload_and_two_workloads_are_refused(
    tiny_model_dir: Path, polytrace_dir: Path, tmp_path: Path
) -> None:
    """`--live PROMPTS --model DIR` (docs/cli.md) was refused with "give at least one --trace";
    `--trace T --synthetic P` ran the synthetic workload and ignored the trace."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "who wrote hamlet?"}\n')
    base = [
        sys.executable, "-m", "toolenv", "rollout", "run", "--engine", "sim", "--clock",
        "virtual", "--exact", "--batch", "1", "--no-plots", "--out", str(tmp_path / "o"),
    ]  # fmt: skip
    live = [*base, "--live", str(prompts), "--model", str(tiny_model_dir)]
    done = subprocess.run(live, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "o" / "report.json").read_text())["summary"]["completed"] == 1
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    params = polytrace_dir / "intern_s1" / "enhanced_task_distribution_parameters.json"
    both = [*base[:7], "--trace", str(trace), "--synthetic", str(params), "--out", str(tmp_path)]
    done = subprocess.run(both, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert (
        done.stderr == "error: --trace and --synthetic each choose the workload: give one of them\n"
    )


@pytest.mark.parametrize("by", ["step", "time"])
def test_a_drift_profile_moves_on_with_the_runs_step_or_clock(by: str, tmp_path: Path) -> None:
    """A `drift` profile (as `emulators fit --per-step` writes) stayed at its first stage for a
    whole virtual-time run: the call's step was not passed to it, and by time it read the wall
    clock (the milliseconds the simulation took), where the emulators, live, take `X-Step` and
    their own clock. Stage 0 answers in 0.1 s, the next in 20 s: by step from step 1 on, by time
    from 5 modelled seconds on (turn 0's call comes at once, turn 1's after 300 tokens, ~5.6 s)."""
    start = {"step": 1, "time": 5}[by]
    profile = tmp_path / "drift.yaml"
    profile.write_text(
        f"tool: search\nmodel:\n  kind: drift\n  by: {by}\n  schedule:\n"
        "  - {start: 0, model: {kind: constant, value_s: 0.1}}\n"
        f"  - {{start: {start}, model: {{kind: constant, value_s: 20.0}}}}\n"
    )
    settings = RolloutSettings(
        engine="sim", clock="virtual", tool_profiles={"search": str(profile)}, batch=1, steps=2
    )

    def trajectory(tid: str) -> TrajectoryPlan:
        calls = [ToolCallPlan("search", {"query": f"{tid} {i}"}, 8) for i in range(2)]
        turns = [TurnPlan(2, [calls[0]], "tool_calls"), TurnPlan(300, [calls[1]], "tool_calls")]
        return TrajectoryPlan(tid, 64, [*turns, TurnPlan(2, [], "stop")])

    report = run_virtual(run_rollout(settings, iter([trajectory("a"), trajectory("b")])))
    latencies = [[c.latency_s for c in r.tool_calls] for r in report["_records"]]
    if by == "step":
        assert latencies == [[0.1, 0.1], [20.0, 20.0]]
    else:
        assert latencies == [[0.1, 20.0], [20.0, 20.0]]


def test_a_tool_profile_of_another_tool_is_refused(polytrace_dir: Path, tmp_path: Path) -> None:
    """`--tool-profile search=reward_default.yaml` ran, each search call taking a sandbox batch's
    ~80 s, where the search emulator refuses a profile whose `tool:` is not its own."""
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    profile = shipped_profile_path("reward_default")
    args = ["rollout", "run", "--engine", "sim", "--clock", "virtual", "--trace", str(trace)]
    args += ["--limit", "2", "--no-plots", "--out", str(tmp_path / "o")]
    done = CliRunner().invoke(build_app(), [*args, "--tool-profile", f"search={profile}"])
    assert done.exit_code == 2, (done.output, done.exception)
    assert done.stderr == (
        f"error: --tool-profile search={profile}: the profile is for 'reward' (its `tool:`), not "
        f"'search': give reward={profile}, or a profile of 'search'\n"
    )
    assert not (tmp_path / "o").exists()
