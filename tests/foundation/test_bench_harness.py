"""The benchmarks' shared harness as a user meets it: a report path that cannot be written is
refused before the run (it failed in a traceback after minutes of work), and a server being
started when Ctrl-C comes, or running when SIGTERM comes, is stopped (it runs in its own
session: nothing else stopped it)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from benchmarks import emulators_bench, fork_server_bench, rollout_virtual_bench, run_tests_budget
from benchmarks.harness import ServerProcess, free_port, report_path

REPO_ROOT = Path(__file__).resolve().parents[2]

# every benchmark that writes a report, and the options naming its files
REPORTING = [
    ("benchmarks.sandboxd_bench", "--out"),
    ("benchmarks.fork_server_bench", "--out"),
    ("benchmarks.fork_server_budget", "--out"),
    ("benchmarks.fork_server_budget", "--png"),
    ("benchmarks.run_tests_budget", "--out"),
    ("benchmarks.emulators_bench", "--out"),
    ("benchmarks.gateway_bench", "--out"),
    ("benchmarks.stress_bench", "--out"),
    ("benchmarks.ray_bench", "--out"),
    ("benchmarks.rollout_virtual_bench", "--out"),
    ("benchmarks.docker_exec_bench", "--out"),
]


class _Parsed(Exception):
    """Raised once the arguments parsed: the benchmark itself never runs in these tests."""


@pytest.mark.parametrize(("module", "option"), REPORTING)
def test_an_unwritable_report_path_is_refused_before_the_run(
    module: str, option: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
        parse(self, *a, **k)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    argv = [option, "/proc/no-such-dir/report.json"]
    if option != "--out":
        argv += ["--out", "report.json"]
    monkeypatch.setattr(sys, "argv", [module, *argv])
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exited:
        main(argv) if inspect.signature(main).parameters else main()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: cannot write /proc/no-such-dir/report.json" in err


def test_report_path_says_what_is_wrong_and_makes_nothing(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory; give a file name"):
        report_path(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match="a-file is not a directory"):
        report_path(str(tmp_path / "a-file" / "r.json"))
    fresh = tmp_path / "new" / "deeper" / "r.json"
    assert report_path(str(fresh)) == fresh
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # made at write time


def test_a_server_interrupted_while_starting_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the harness waited for readiness left the server running in its session."""
    calls = []

    def interrupted(*a: Any, **k: Any) -> Any:
        calls.append(a)
        raise KeyboardInterrupt

    monkeypatch.setattr(httpx, "get", interrupted)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    server = ServerProcess(sleeper, free_port(), stop_timeout_s=5)
    try:
        with pytest.raises(KeyboardInterrupt):
            server.start()
        assert calls, "the readiness probe was not reached"
        assert server.proc is not None and server.proc.poll() is not None
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait()


@pytest.mark.parametrize("bench", ["fork_server_bench", "run_tests_budget"])
def test_the_first_server_of_a_pair_is_stopped_when_the_second_fails(
    bench: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """fork_server_bench and run_tests_budget start two servers; a second that failed to start
    left the first running."""
    stopped = []

    class _Fake:
        def stop(self) -> None:
            stopped.append(self)

    first = _Fake()

    def start_server(fork_server: bool, max_concurrency: int) -> Any:
        if fork_server:
            return first
        raise RuntimeError("not ready within 60 s")

    for module in (fork_server_bench, run_tests_budget):
        monkeypatch.setattr(module, "start_server", start_server, raising=False)
    with pytest.raises(RuntimeError, match="not ready"):
        if bench == "fork_server_bench":
            args = argparse.Namespace(quick=True, max_concurrency=16)
            asyncio.run(fork_server_bench.measure(args, Console(file=io.StringIO())))
        else:
            run_tests_budget.main(["--quick", "--out", str(tmp_path / "r.json")])
    assert stopped == [first]


SERVE_THEN_WAIT = """
import sys, time
from benchmarks.harness import ServerProcess, free_port
port = free_port()
argv = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]
with ServerProcess(argv, port, ready_path="/", stop_timeout_s=5) as server:
    print(server.pid, flush=True)
    time.sleep(60)
"""


def test_sigterm_to_a_benchmark_stops_the_servers_it_started(tmp_path: Path) -> None:
    """`kill` or `timeout` ended a benchmark at once: every server it had started (each in its
    own session) ran on. It now unwinds like Ctrl-C and exits 143."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    bench = subprocess.Popen(
        [sys.executable, "-c", SERVE_THEN_WAIT],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert bench.stdout is not None
    server_pid = int(bench.stdout.readline())
    try:
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(30) == 128 + signal.SIGTERM
        give_up = time.monotonic() + 10
        while _alive(server_pid) and time.monotonic() < give_up:
            time.sleep(0.05)
        assert not _alive(server_pid), "the server outlived the benchmark"
    finally:
        bench.kill()
        bench.wait()
        if _alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for init to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class _Reached(Exception):
    """The benchmark got past finding its trace: it stops here instead of running."""


@pytest.mark.parametrize("cached", [True, False])
def test_the_default_trace_is_found_where_toolenv_traces_fetch_puts_it(
    cached: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Both trace-reading benchmarks looked beside the repository's folder (this project's own
    machines), never in the trace cache the docs fill: emulators_bench died in a traceback,
    rollout_virtual_bench named an undocumented variable."""
    cache = tmp_path / "cache"
    step = cache / "search_r1" / "multiturn_workload_step_0.jsonl"
    if cached:
        step.parent.mkdir(parents=True)
        step.write_text("{}\n")
    monkeypatch.delenv("TOOLENV_POLYTRACE_DIR", raising=False)
    monkeypatch.setenv("TOOLENV_TRACES_CACHE_DIR", str(cache))
    read: list[Path] = []

    def reached(paths: Any, *a: Any, **k: Any) -> Any:
        read.append(Path(paths[0]) if isinstance(paths, list) else Path(paths))
        raise _Reached

    monkeypatch.setattr(emulators_bench, "tool_latencies", reached)
    monkeypatch.setattr(rollout_virtual_bench, "baseline", reached)
    out = ["--quick", "--out", str(tmp_path / "r.json")]
    monkeypatch.setattr(sys, "argv", ["rollout_virtual_bench", *out])
    for run in (lambda: emulators_bench.main(out), rollout_virtual_bench.main):
        if cached:
            with pytest.raises(_Reached):
                run()
        else:
            with pytest.raises(SystemExit) as exited:
                run()
            assert exited.value.code == 2
            err = capsys.readouterr().err
            assert f"nor in the trace cache {cache}" in err and "toolenv traces fetch" in err
    if cached:
        assert read == [step.parent, step]


@pytest.mark.parametrize(
    ("module", "argv", "says"),
    [
        ("benchmarks.gateway_bench", ["--rates", "500,abc"], "--rates: 'abc' is not a number"),
        ("benchmarks.gateway_bench", ["--rates", "500,0"], "--rates: 0 is not a number above 0"),
        ("benchmarks.emulators_bench", ["--rates", "-5"], "--rates: -5 is not a number above 0"),
        ("benchmarks.sandboxd_bench", ["--backends", "procss"], "--backends: no backend procss"),
        ("benchmarks.ray_bench", ["--rounds", "0"], "--rounds: 0 is not a count above 0"),
        ("benchmarks.ray_bench", ["--seconds", "-1"], "--seconds: -1 is not a number above 0"),
    ],
)
def test_a_bad_argument_is_refused_before_anything_runs(
    module: str,
    argv: list[str],
    says: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each was refused by the load generator in a traceback, or reported as a failing backend,
    after the baselines and servers had run."""
    bench = importlib.import_module(module)
    for name in ("amain", "measure", "bench", "polytrace_file", "tool_latencies"):  # not reached
        monkeypatch.setattr(bench, name, _never, raising=False)
    with pytest.raises(SystemExit) as exited:
        bench.main([*argv, "--quick", "--out", str(tmp_path / "r.json")])
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def _never(*a: Any, **k: Any) -> Any:
    raise AssertionError("the benchmark ran")


def test_a_failing_policy_run_says_why() -> None:
    """rollout_virtual_bench threw its child's stderr away: a `--policies` typo said "exited 2"."""
    with pytest.raises(RuntimeError, match="exited 1: unknown policy 'bogus'"):
        rollout_virtual_bench._child(
            [sys.executable, "-c", "raise SystemExit(\"unknown policy 'bogus'\")"]
        )


def test_a_trace_without_search_calls_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """emulators_bench --trace verl_dapo (no tool calls) ended in a ValueError traceback."""
    trace = tmp_path / "packed_lengths_step_0.jsonl"
    record = '{"step": 0, "rank": 0, "dp_rank": 0, "tp_rank": 0, "local_index": 0, "input": 112, '
    trace.write_text(record + '"output": [450, 453], "n_sampling": 2, "validate": false}\n')
    with pytest.raises(SystemExit) as exited:
        emulators_bench.main(["--trace", str(trace), "--out", str(tmp_path / "r.json")])
    assert exited.value.code == 2
    assert "no calls of tool 'search'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("module", "ends"),
    [
        ("benchmarks.fork_server_budget", "and for the bare spawn floor."),
        ("benchmarks.run_tests_budget", "on the fork server and on warm spawn."),
    ],
)
def test_help_says_the_whole_first_sentence(
    module: str, ends: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Their `--help` stopped at the docstring's first line: "where the machine's CPU goes per"."""
    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    assert ends in " ".join(capsys.readouterr().out.split())


def test_the_virtual_rollout_bench_takes_a_step_of_any_size(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """A `--trace` that was not a 2,048-trajectory step failed the baseline's `assert n == 2048`
    in a traceback; the step's own count is now the batch."""
    step = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    with step.open() as lines:
        few = [next(lines) for _ in range(5)]
    trace = tmp_path / "five.jsonl"
    trace.write_text("".join(few))
    seconds, trajectories = rollout_virtual_bench.baseline(trace)
    assert trajectories == 5 and seconds > 0
    row = rollout_virtual_bench.run_policy(trace, "async", tmp_path / "out", trajectories)
    assert row["trajectories"] == 5, row
