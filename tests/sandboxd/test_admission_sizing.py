"""Admission that fits the work: the default limit is on programs in flight, sized from cores
and memory, so sleeping programs do not hold back a fast one; the status says why a call waits."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from sbx_support import SandboxdServer
from typer.testing import CliRunner

from sandboxd.cli import app
from sandboxd.settings import SandboxSettings
from sandboxd.sizing import PROGRAMS_PER_CORE, Sizing, host_sizing

pytestmark = pytest.mark.bwrap

SLEEP = "import time\ntime.sleep(3)\nprint('slept')"


def test_sizing_is_the_smaller_of_cpu_and_memory_bounds() -> None:
    assert Sizing(cores=2, memory_mb=24_000, per_run_mb=512).limit == 2 * PROGRAMS_PER_CORE
    assert Sizing(cores=64, memory_mb=4096, per_run_mb=512).limit == 4  # memory bound
    assert Sizing(cores=1, memory_mb=256, per_run_mb=512).limit == 2  # never below 2
    host = host_sizing(512)
    assert host.cores >= 1 and host.memory_mb > 0
    assert "cores" in host.describe() and "MB memory" in host.describe()


def test_docker_admission_is_never_larger_than_the_pool() -> None:
    """One run per container: admission sized from the host (8 on 2 cores) let in more runs
    than a pool of 4 holds, and the rest waited inside it, outside the queue's bounds."""
    pooled = SandboxSettings(backend="docker", docker_pool_size=2, max_concurrency=6)
    assert pooled.concurrency == 2
    assert pooled.admission_reason() == (
        "2 programs in flight: docker_pool_size (one run per container), below "
        "6 programs in flight: the max_concurrency setting"
    )
    sized = SandboxSettings(backend="docker", docker_pool_size=1)
    assert sized.concurrency == 1 and "cores" in sized.admission_reason()
    big_pool = SandboxSettings(backend="docker", docker_pool_size=16, max_concurrency=6)
    assert big_pool.concurrency == 6
    assert big_pool.admission_reason() == "6 programs in flight: the max_concurrency setting"
    process = SandboxSettings(backend="process", docker_pool_size=2, max_concurrency=6)
    assert process.concurrency == 6


def _in_background(server: SandboxdServer, n: int) -> list[threading.Thread]:
    threads = [
        threading.Thread(target=server.run_code, kwargs={"code": SLEEP, "run_timeout": 10})
        for _ in range(n)
    ]
    for t in threads:
        t.start()
    return threads


def _wait_running(server: SandboxdServer, n: int) -> None:
    for _ in range(200):
        if server.client.get("/v1/sandbox/status").json()["admission"]["running"] >= n:
            return
        threading.Event().wait(0.02)
    raise AssertionError(f"{n} programs never ran at once")


def test_sleeping_programs_do_not_hold_back_a_fast_one(
    sandboxd_factory: Callable[..., SandboxdServer],
) -> None:
    server = sandboxd_factory("--backend", "process")  # the default limit
    status = server.client.get("/v1/sandbox/status").json()["admission"]
    assert status["capacity"] == host_sizing(512).limit >= 5
    assert "cores" in status["limit_from"] and status["waits_because"] is None
    sleepers = _in_background(server, 4)
    _wait_running(server, 4)
    fast = server.run_code(code="print(6 * 7)")
    assert fast["run_result"]["stdout"] == "42\n"
    # the fast call was not queued behind them: they are all still sleeping
    assert server.client.get("/v1/sandbox/status").json()["admission"]["running"] == 4
    for t in sleepers:
        t.join(30)


def test_status_says_why_a_call_waits(sandboxd_factory: Callable[..., SandboxdServer]) -> None:
    server = sandboxd_factory("--backend", "process", "--max-concurrency", "1")
    sleeper = _in_background(server, 1)
    _wait_running(server, 1)
    queued = _in_background(server, 1)
    for _ in range(200):
        status = server.client.get("/v1/sandbox/status").json()["admission"]
        if status["waiting"] == 1:
            break
        threading.Event().wait(0.02)
    assert status["limit_from"] == "1 programs in flight: the max_concurrency setting"
    assert "all 1 program slots are in flight" in status["waits_because"]
    for t in sleeper + queued:
        t.join(30)
    assert server.client.get("/v1/sandbox/status").json()["admission"]["waits_because"] is None


def test_serve_help_gives_the_default_sizing() -> None:
    """`--max-concurrency` said "0: 2 x CPU cores"; the default is 4 per core, capped by memory."""

    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0
    assert "2 x CPU cores" not in result.output
    assert f"0: {PROGRAMS_PER_CORE} per CPU core, fewer if memory" in result.output
