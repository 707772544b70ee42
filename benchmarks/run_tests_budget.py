"""`python -m benchmarks.run_tests_budget --out FILE`: where the machine's CPU goes per case of
a python `/v1/run_tests` request of 100 small cases, on the fork server and on warm spawn.

`fork_server_bench` times the two paths per case (wall clock, settled rounds); this accounts for
the machine's CPU behind each, with the arithmetic of `fork_server_budget` (`cpu_budget`). Both
servers run as `fork_server_bench` starts them. For each path in turn, one window bounded by two
/proc snapshots holds `--requests` sequential requests of `RUN_TESTS_BODY`, each started settled
(`fork_server_bench.settle`), and the settle after the last one, so that the warm-spawn pool's
refill is inside its window. The busy time is split by group per case, and the ratio by CPU
(warm spawn's ms per case over the fork server's, both net of other users' work, the other
server counted as another user) is set against the 5x target.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from .cpu_budget import CLK_TCK, LOADGEN, ORDER, account, snapshot
from .fork_server_bench import CASES, TARGETS, run_tests_once, settle, start_pair
from .fork_server_budget import per_run
from .harness import ServerProcess, report_path, write_report

CORES = os.cpu_count() or 1


def window(
    client: httpx.Client,
    server: ServerProcess,
    warm: ServerProcess,
    requests: int,
    console: Console,
) -> dict[str, Any]:
    """`requests` settled /v1/run_tests calls to `server` inside one /proc window, per case."""
    settle(client, warm)
    load = os.getloadavg()
    console.print(f"{requests} requests of {CASES} cases to {server.url} (load {load})")
    unsettled, seconds = 0, 0.0
    before = snapshot()
    for _ in range(requests):
        seconds += run_tests_once(client, server.url) * CASES
        unsettled += not settle(client, warm)
    after = snapshot()
    cases = requests * CASES
    out = per_run(account(before, after, os.getpid(), server.pid), cases, round(cases / seconds))
    out["wall_ms_per_case"] = round(seconds * 1000 / cases, 3)
    out.update({"requests": requests, "settles_timed_out": unsettled, "load_avg_at_start": load})
    return out


def floor(fork: dict[str, Any], warm: dict[str, Any]) -> dict[str, Any]:
    """The ratio by CPU and what the fork server's CPU per case would have to be for 5x."""
    target = TARGETS["run_tests_speedup"]
    return {
        "ratio_wall": round(warm["wall_ms_per_case"] / fork["wall_ms_per_case"], 2),
        "ratio_by_cpu": round(warm["ours_ms_per_run"] / fork["ours_ms_per_run"], 2),
        "fork_ms_per_case_net_of_others": fork["ours_ms_per_run"],
        "warm_ms_per_case_net_of_others": warm["ours_ms_per_run"],
        "fork_ms_per_case_without_load_generator": round(
            fork["ours_ms_per_run"] - fork["ms_per_run"].get(LOADGEN, 0.0), 3
        ),
        "target_ms_per_case_5x_from_cpu": round(warm["ours_ms_per_run"] / target, 3),
    }


def print_report(report: dict[str, Any], console: Console) -> None:
    fork, warm = report["fork_server"], report["warm_spawn"]
    t = Table(title=f"machine CPU per /v1/run_tests case ({CASES} cases, ms)", title_justify="left")
    for col in ("where", "fork server", "warm spawn"):
        t.add_column(col, justify="left" if col == "where" else "right")
    for name in [n for n in ORDER if n in fork["ms_per_run"] or n in warm["ms_per_run"]]:
        t.add_row(name, *(f"{s['ms_per_run'].get(name, 0.0):.3f}" for s in (fork, warm)))
    for label, key in (
        ("machine busy", "machine_busy_ms_per_run"),
        ("net of others", "ours_ms_per_run"),
        ("wall per case", "wall_ms_per_case"),
    ):
        t.add_row(label, f"{fork[key]:.3f}", f"{warm[key]:.3f}")
    console.print(t)
    console.print(report["floor"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=report_path, default=None, help="write the JSON report here")
    parser.add_argument("--requests", type=int, default=20, help="requests per path")
    parser.add_argument("--quick", action="store_true", help="5 requests per path (a smoke check)")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests = 5
    console = Console(stderr=True)
    started = time.monotonic()
    fork, warm = start_pair(16)
    try:
        with httpx.Client() as client:
            console.print("warming up: 2 requests to each server")
            for server in (fork, warm, fork, warm):
                settle(client, warm)
                run_tests_once(client, server.url)
            fork_side = window(client, fork, warm, args.requests, console)
            warm_side = window(client, warm, warm, args.requests, console)
    finally:
        fork.stop()
        warm.stop()
    report: dict[str, Any] = {
        "benchmark": "run_tests_budget",
        "machine": {"cpus": CORES, "platform": platform.platform(), "clk_tck": CLK_TCK},
        "fork_server": fork_side,
        "warm_spawn": warm_side,
        "floor": floor(fork_side, warm_side),
    }
    report["machine"]["load_avg_at_end"] = os.getloadavg()
    report["seconds"] = round(time.monotonic() - started, 1)
    print_report(report, console)
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
