"""`python -m benchmarks.fork_server_budget --out FILE`: where the machine's CPU goes per
python `print(1)` run at concurrency 16, through the fork server and for the bare spawn floor.

The per-part figures (the zygote's tree without HTTP, the served process's own CPU) leave part
of the machine's roughly 6 ms per run unexplained; this accounts for all of it over the
measured window itself. A real `toolenv sandboxd serve --max-concurrency 16` (fork server on)
takes `--runs` closed-loop runs at c16 from this process; then the bare `/usr/bin/python3 -c`
spawn from 16 threads takes `--bare-runs`. Around each, /proc is read (`benchmarks.cpu_budget`)
and the machine's busy time is split into this process (the load generator), its reaped
children (the bare spawns), the sandboxd server, the sandbox tree (bwrap, zygote and runners,
live or reaped), kernel threads by name, everything else on the machine (other users' work,
subtracted) and what is left unattributed. From these: the runs/s ceiling of the sandbox path
(cores / its CPU per run), the zygote tree's alone, and the CPU per run 2.5x bare python needs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time
from pathlib import Path
from typing import Any

import matplotlib
from rich.console import Console
from rich.table import Table

from .cpu_budget import (
    CLK_TCK,
    LOADGEN,
    ORDER,
    OTHER,
    RUNNERS,
    SERVER,
    TREE,
    UNATTRIBUTED,
    ZYGOTE,
    TopSampler,
    account,
    own_ticks,
    snapshot,
)
from .fork_server_bench import TARGETS, start_server
from .harness import report_path, wait_until_idle, write_report
from .sandboxd_bench import PROGRAM, PYTHON, closed_loop, time_subprocess

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

CORES = os.cpu_count() or 1
SPAWN_WARMUP = 3  # time_subprocess runs 3 unmeasured spawns inside the window


def per_run(
    acc: dict[str, Any], runs: int, rps: float, zygote: int | None = None
) -> dict[str, Any]:
    """Ticks to ms per run (the tree split into the zygote's own and its runners' when
    `zygote` ticks are given); the machine's busy time net of other users' work."""
    ms = 1000.0 / CLK_TCK / runs
    ticks = {**acc["groups_ticks"], UNATTRIBUTED: acc["unattributed_ticks"]}
    if zygote is not None:
        ticks[ZYGOTE], ticks[RUNNERS] = zygote, ticks.pop(TREE) - zygote
    groups = {k: round(ticks[k] * ms, 3) for k in ORDER if ticks.get(k)}
    busy = acc["busy_ticks"] * ms
    ours = busy - groups.get(OTHER, 0.0)
    kernel = sum(v for k, v in groups.items() if k.startswith(("kernel", "unattributed")))
    return {
        "runs": runs,
        "runs_per_s": rps,
        "window_s": round(acc["elapsed_ticks"] / CLK_TCK / CORES, 2),
        "machine_busy_share": round(acc["busy_ticks"] / acc["elapsed_ticks"], 3),
        "per_cpu_busy_share": acc["per_cpu_busy_share"],
        "kernel_threads_died_unseen": acc["kernel_threads_died_unseen"],
        "other_users_top_ms_per_run": {
            k: round(v * ms, 3) for k, v in acc["other_users_top_ticks"].items()
        },
        "ms_per_run": groups,
        "machine_busy_ms_per_run": round(busy, 3),
        "ours_ms_per_run": round(ours, 3),  # everything but other users' work
        "kernel_ms_per_run": round(kernel, 3),
    }


async def measure(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    bench = os.getpid()
    server = start_server(True, 16)
    try:
        console.print("warm-up: 50 runs at c4, 200 at c16")
        await closed_loop(server.url, 4, 50)
        await closed_loop(server.url, 16, 200)
        wait_until_idle()
        load_fork = os.getloadavg()
        console.print(f"fork server: {args.runs} runs at c16 (load average {load_fork})")
        sampler = TopSampler(server.pid)
        first = sampler.sample()
        before = snapshot()
        sampler.start()
        result = await closed_loop(server.url, 16, args.runs)
        after = snapshot()
        zygote = own_ticks(first, sampler.stop())
        acc = account(before, after, bench, server.pid)
        fork = per_run(acc, args.runs, result["rps"], zygote)
        fork["zygotes_started"] = sum(1 for k in sampler.last if k not in first) // 2
        fork.update({"failed": result["failed"], "rejected_429": result["rejected_429"]})
        fork["load_avg_at_start"] = load_fork
    finally:
        server.stop()
    wait_until_idle()
    load_bare = os.getloadavg()
    console.print(f"bare python -c: {args.bare_runs} spawns from 16 threads (load {load_bare})")
    before = snapshot()
    spawn = time_subprocess([PYTHON, "-c", PROGRAM], args.bare_runs, 16)
    after = snapshot()
    bare = per_run(account(before, after, bench), args.bare_runs + SPAWN_WARMUP, spawn["rps"])
    bare["load_avg_at_start"] = load_bare
    return {"fork_server_c16": fork, "bare_python_c16": bare, "floor": floor(fork, bare)}


def floor(fork: dict[str, Any], bare: dict[str, Any]) -> dict[str, Any]:
    """The ceilings the CPU per run allows on this machine's cores, and what 2.5x needs."""
    f = fork["ms_per_run"]
    sandbox_path = fork["ours_ms_per_run"] - f.get(LOADGEN, 0.0)  # server, tree, kernel
    tree = f.get(ZYGOTE, 0.0) + f.get(RUNNERS, 0.0)
    target = TARGETS["rps_c16_over_bare"]
    target_rps = target * bare["runs_per_s"]
    return {
        "ratio_measured": round(fork["runs_per_s"] / bare["runs_per_s"], 2),
        "sandbox_path_ms_per_run": round(sandbox_path, 3),
        "ceiling_rps_sandbox_path": round(CORES * 1000 / sandbox_path, 1),
        "ceiling_rps_with_load_generator": round(CORES * 1000 / fork["ours_ms_per_run"], 1),
        "sandbox_tree_ms_per_run": round(tree, 3),
        "ceiling_rps_zygote_tree_alone": round(CORES * 1000 / tree, 1),
        # at most one core each: the zygote (one thread) forks every runner, and the server's
        # CPU is nearly all its event loop's
        "ceiling_rps_zygote_one_core": round(1000 / max(f.get(ZYGOTE, 0.0), 0.001), 1),
        "ceiling_rps_server_one_core": round(1000 / f[SERVER], 1),
        "bare_ms_per_run_net_of_others": bare["ours_ms_per_run"],
        "target_rps_2_5x": round(target_rps, 1),
        "target_ms_per_run_2_5x": round(CORES * 1000 / target_rps, 3),
        # load-independent: both paths' CPU per run net of other users' work, load generators in
        "ratio_if_cpu_bound": round(bare["ours_ms_per_run"] / fork["ours_ms_per_run"], 2),
        "target_ms_per_run_2_5x_from_cpu": round(bare["ours_ms_per_run"] / target, 3),
    }


def print_report(report: dict[str, Any], console: Console) -> None:
    fork, bare = report["fork_server_c16"], report["bare_python_c16"]
    t = Table(title="machine CPU per print(1) run at c16 (ms)", title_justify="left")
    for col in ("where", "fork server", "share", "bare python -c", "share"):
        t.add_column(col, justify="left" if col == "where" else "right")
    names = [n for n in ORDER if n in fork["ms_per_run"] or n in bare["ms_per_run"]]
    for name in names:
        cells = [name]
        for side in (fork, bare):
            v = side["ms_per_run"].get(name, 0.0)
            cells += [f"{v:.3f}", f"{v / side['machine_busy_ms_per_run']:.0%}"]
        t.add_row(*cells)
    for label, key in (
        ("machine busy", "machine_busy_ms_per_run"),
        ("net of others", "ours_ms_per_run"),
    ):
        t.add_row(label, f"{fork[key]:.3f}", "", f"{bare[key]:.3f}", "")
    t.add_row("runs/s", str(fork["runs_per_s"]), "", str(bare["runs_per_s"]), "")
    console.print(t)
    console.print(report["floor"])


def plot(report: dict[str, Any], path: Path) -> None:
    """A stacked bar per path: ms of machine CPU per run by where it went."""
    sides = {"fork server": report["fork_server_c16"], "bare python -c": report["bare_python_c16"]}
    names = [n for n in ORDER if any(n in s["ms_per_run"] for s in sides.values())]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottoms = [0.0] * len(sides)
    for name in names:
        values = [max(s["ms_per_run"].get(name, 0.0), 0.0) for s in sides.values()]
        ax.bar(list(sides), values, bottom=bottoms, label=name)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.axhline(report["floor"]["target_ms_per_run_2_5x"], color="k", ls="--", label="2.5x needs")
    ax.set_ylabel("machine CPU ms per print(1) run, c16")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=report_path, default=None, help="write the JSON report here")
    parser.add_argument("--png", type=report_path, default=None, help="a stacked bar chart here")
    parser.add_argument("--quick", action="store_true", help="fewer runs (for a smoke check)")
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--bare-runs", type=int, default=1500)
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.bare_runs = 600, 300
    console = Console(stderr=True)
    started = time.monotonic()
    report: dict[str, Any] = {
        "benchmark": "fork_server_budget",
        "machine": {"cpus": CORES, "platform": platform.platform(), "clk_tck": CLK_TCK},
    }
    report.update(asyncio.run(measure(args, console)))
    report["machine"]["load_avg_at_end"] = os.getloadavg()
    report["seconds"] = round(time.monotonic() - started, 1)
    print_report(report, console)
    if args.png:
        plot(report, args.png)
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
