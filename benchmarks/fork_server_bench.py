"""`python -m benchmarks.fork_server_bench --out FILE`: the python fork server against its floors.

Each figure is a ratio against a baseline measured in the same run, on the same machine:
- `print(1)` runs/s at concurrency 16 through a real `toolenv sandboxd serve` (fork server on)
  over the bare `/usr/bin/python3 -c` spawn floor at concurrency 16 (target >= 2.5x);
- `print(1)` p50 at concurrency 1, round-robin with bare python so both see the same load
  (target <= 0.5x);
- `/v1/run_tests` with 100 small python cases: time per case with the fork server over the
  warm-spawn path (a second server with `TOOLENV_SANDBOX_FORK_SERVER=false`), alternated
  (target >= 5x). Each round starts with the warm-spawn pool refilled and the machine idle
  again, so that no round pays for what the one before it left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from .harness import ServerProcess, free_port, report_path, wait_until_idle, write_report
from .sandboxd_bench import PROGRAM, PYTHON, closed_loop, interleaved_c1
from .sandboxd_bench import time_subprocess as spawn_floor

TARGETS = {"rps_c16_over_bare": 2.5, "p50_c1_over_bare": 0.5, "run_tests_speedup": 5.0}
CASES = 100
RUN_TESTS_BODY = {
    "code": "n = int(input())\nprint(n * n)\n",
    "language": "python",
    "cases": [{"stdin": f"{i}\n", "expected_stdout": f"{i * i}\n"} for i in range(CASES)],
}


def start_server(fork_server: bool, max_concurrency: int) -> ServerProcess:
    """A real `toolenv sandboxd serve` with the fork server on or off (checked in its status)."""
    port = free_port()
    argv = [sys.executable, "-m", "toolenv", "sandboxd", "serve", "--backend", "process"]
    argv += ["--max-concurrency", str(max_concurrency), "--host", "127.0.0.1", "--port", str(port)]
    env = {"TOOLENV_SANDBOX_FORK_SERVER": "true" if fork_server else "false"}
    server = ServerProcess(argv, port, stop_timeout_s=30, env=env).start()
    try:
        mode = httpx.get(server.url + "/v1/sandbox/status", timeout=5).json()["python_mode"]
        expected = "fork_server" if fork_server else "warm_spawn"
        if mode != expected:
            raise RuntimeError(f"sandboxd runs python as {mode!r}, not {expected!r}")
    except BaseException:
        server.stop()
        raise
    return server


def start_pair(max_concurrency: int) -> tuple[ServerProcess, ServerProcess]:
    """The fork-server and the warm-spawn servers; the first is stopped when the second fails
    to start (each runs in its own session: nothing else would stop it)."""
    fork = start_server(True, max_concurrency)
    try:
        return fork, start_server(False, max_concurrency)
    except BaseException:
        fork.stop()
        raise


def settle(client: httpx.Client, warm_spawn: ServerProcess, timeout_s: float = 5.0) -> bool:
    """Wait until the warm-spawn server's pool is full again and the machine is idle (False:
    it did not settle within `timeout_s` each; the round runs anyway)."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        status = client.get(warm_spawn.url + "/v1/sandbox/status", timeout=5).json()
        if sum(status["warm"].values()) >= status["warm_target"]:
            return wait_until_idle(timeout_s=timeout_s)
        time.sleep(0.05)
    return False


def run_tests_once(client: httpx.Client, url: str) -> float:
    """Seconds per case for one /v1/run_tests call of CASES cases (all must pass). `client`
    is made once, outside the clock: a new one per call costs tens of ms of set-up (its TLS
    context) and a new connection, which no caller of a long-lived service pays."""
    started = time.perf_counter()
    r = client.post(url + "/v1/run_tests", json=RUN_TESTS_BODY, timeout=300)
    elapsed = time.perf_counter() - started
    body = r.json()
    if r.status_code != 200 or body.get("passed") != CASES:
        raise RuntimeError(f"run_tests failed: {r.status_code} {json.dumps(body)[:500]}")
    return elapsed / CASES


async def measure(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    n_c16, n_c1, rounds = (400, 40, 3) if args.quick else (2000, 200, 8)
    fork, warm = start_pair(args.max_concurrency)
    try:
        console.print("warming up both servers")
        await closed_loop(fork.url, 4, 50)
        await closed_loop(warm.url, 4, 50)
        console.print(f"c16 throughput: bare python floor, then the fork server ({n_c16} each)")
        bare_c16 = spawn_floor([PYTHON, "-c", PROGRAM], n_c16, 16)
        fork_c16 = await closed_loop(fork.url, 16, n_c16)
        fork_c16.pop("_latencies")
        bare_c16_again = spawn_floor([PYTHON, "-c", PROGRAM], n_c16, 16)
        console.print(f"c1 p50: {n_c1} rounds interleaved with bare python")
        c1 = await interleaved_c1(fork.url, n_c1)
        console.print(f"run_tests, {CASES} cases: {rounds} rounds alternating the two paths")
        per_case: dict[str, list[float]] = {"fork_server": [], "warm_spawn": []}
        unsettled = 0
        with httpx.Client() as client:
            for _ in range(rounds):
                for name, server in (("fork_server", fork), ("warm_spawn", warm)):
                    unsettled += not settle(client, warm)
                    per_case[name].append(run_tests_once(client, server.url))
        status = httpx.get(fork.url + "/v1/sandbox/status", timeout=5).json()
    finally:
        fork.stop()
        warm.stop()
    floor_rps = statistics.mean([bare_c16["rps"], bare_c16_again["rps"]])
    fork_ms = statistics.median(per_case["fork_server"]) * 1000
    warm_ms = statistics.median(per_case["warm_spawn"]) * 1000
    ratios = {
        "rps_c16_over_bare": round(fork_c16["rps"] / floor_rps, 2),
        "p50_c1_over_bare": round(c1["service"]["p50_ms"] / c1["bare_python"]["p50_ms"], 2),
        "run_tests_speedup": round(warm_ms / fork_ms, 2),
    }
    return {
        "bare_python_c16": {"before": bare_c16, "after": bare_c16_again, "rps_mean": floor_rps},
        "fork_server_c16": fork_c16,
        "c1_interleaved": c1,
        "run_tests_ms_per_case": {
            "fork_server": round(fork_ms, 3),
            "warm_spawn": round(warm_ms, 3),
            "rounds": {k: [round(v * 1000, 3) for v in vs] for k, vs in per_case.items()},
            "rounds_started_unsettled": unsettled,
        },
        "fork_server_status": status.get("fork_server"),
        "ratios": ratios,
        "targets": TARGETS,
        "meets": {
            "rps_c16_over_bare": ratios["rps_c16_over_bare"] >= TARGETS["rps_c16_over_bare"],
            "p50_c1_over_bare": ratios["p50_c1_over_bare"] <= TARGETS["p50_c1_over_bare"],
            "run_tests_speedup": ratios["run_tests_speedup"] >= TARGETS["run_tests_speedup"],
        },
    }


def print_report(report: dict[str, Any], console: Console) -> None:
    t = Table(title="python fork server: print(1) and run_tests", title_justify="left")
    for col in ("what", "measured", "baseline (same run)", "ratio", "target"):
        t.add_column(col)
    c1 = report["c1_interleaved"]
    rt = report["run_tests_ms_per_case"]
    r, tg = report["ratios"], report["targets"]
    t.add_row(
        "runs/s at c16",
        str(report["fork_server_c16"]["rps"]),
        f"{report['bare_python_c16']['rps_mean']:.1f} (bare python -c)",
        str(r["rps_c16_over_bare"]),
        f">= {tg['rps_c16_over_bare']}",
    )
    t.add_row(
        "p50 ms at c1",
        str(c1["service"]["p50_ms"]),
        f"{c1['bare_python']['p50_ms']} (bare python -c)",
        str(r["p50_c1_over_bare"]),
        f"<= {tg['p50_c1_over_bare']}",
    )
    t.add_row(
        f"run_tests ms/case ({CASES} cases)",
        str(rt["fork_server"]),
        f"{rt['warm_spawn']} (warm spawn)",
        f"{r['run_tests_speedup']}x faster",
        f">= {tg['run_tests_speedup']}x",
    )
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=report_path, default=None, help="write the JSON report here")
    parser.add_argument("--quick", action="store_true", help="fewer runs (for a smoke check)")
    parser.add_argument("--max-concurrency", type=int, default=16)
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    report: dict[str, Any] = {
        "benchmark": "fork_server",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_at_start": os.getloadavg(),
        },
    }
    report.update(asyncio.run(measure(args, console)))
    report["machine"]["load_avg_at_end"] = os.getloadavg()
    print_report(report, console)
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
