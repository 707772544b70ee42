"""Benchmark of the docker backend itself (no HTTP): `print(1)` in python, latency and throughput.

    python -m benchmarks.docker_exec_bench [--out FILE] [--json] [--pool-size N]

Baselines measured in the same run: a bare `/usr/bin/python3 -c 'print(1)'` subprocess on the
host, and `docker exec` of the same command into a running container of the sandbox image (the
floor a pool that execs per run cannot beat). Figures are printed as ratios against them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from sandboxd.docker_backend.backend import DockerBackend
from sandboxd.models import RunSpec
from sandboxd.settings import SandboxSettings
from toolenv_core.deadline import Deadline

from .harness import report_path, unwind_on_sigterm, write_report

PRINT1 = RunSpec(language="python", code="print(1)")


def summary(latencies_s: list[float], elapsed_s: float) -> dict[str, float]:
    ms = np.asarray(latencies_s) * 1000
    return {
        "runs": len(ms),
        "p50_ms": round(float(np.percentile(ms, 50)), 2),
        "p99_ms": round(float(np.percentile(ms, 99)), 2),
        "runs_per_s": round(len(ms) / elapsed_s, 1),
    }


async def interleaved(
    baseline, subject, n: int, concurrency: int, rounds: int = 4
) -> tuple[dict[str, float], dict[str, float]]:
    """Baseline and subject in alternating rounds, so load from elsewhere hits both alike."""
    lat: dict[str, list[float]] = {"baseline": [], "subject": []}
    elapsed = {"baseline": 0.0, "subject": 0.0}
    for _ in range(rounds):
        for key, one in (("baseline", baseline), ("subject", subject)):
            t = time.perf_counter()
            lat[key] += await _loop(one, max(1, n // rounds), concurrency)
            elapsed[key] += time.perf_counter() - t
    return summary(lat["baseline"], elapsed["baseline"]), summary(
        lat["subject"], elapsed["subject"]
    )


async def closed_loop(one, n: int, concurrency: int) -> dict[str, float]:
    started = time.perf_counter()
    latencies = await _loop(one, n, concurrency)
    return summary(latencies, time.perf_counter() - started)


async def _loop(one, n: int, concurrency: int) -> list[float]:
    """`n` calls of `one()` from `concurrency` workers, each starting the next when one ends."""
    latencies: list[float] = []
    left = n

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t = time.perf_counter()
            await one()
            latencies.append(time.perf_counter() - t)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies


async def bare_python() -> None:
    proc = await asyncio.create_subprocess_exec(
        "/usr/bin/python3",
        "-c",
        "print(1)",
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin"},
    )
    out, _ = await proc.communicate()
    assert out == b"1\n"


async def docker_exec_floor(image: str, n: int) -> dict[str, float]:
    name = f"toolenv-bench-exec-{os.getpid()}"
    subprocess.run(
        ["docker", "run", "-d", "--rm", "--name", name, "--network", "none", image, "sleep", "600"],
        check=True,
        capture_output=True,
    )
    try:

        async def one() -> None:
            proc = await asyncio.create_subprocess_exec(
                "docker", "exec", name, "/usr/bin/python3", "-c", "print(1)",
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            await proc.communicate()

        return await closed_loop(one, n, 1)
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)


def _proc_cpu(pid: int) -> tuple[float, float]:
    """(own CPU, CPU of reaped children) of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick, (int(fields[13]) + int(fields[14])) / tick


async def cpu_per_run(backend: DockerBackend, one, n: int) -> dict[str, float]:
    """Where the CPU of a run goes: the program, the agent, this (host) process. Load-proof."""
    pids = [
        backend._client.api.inspect_container(c.id)["State"]["Pid"]
        for c in backend.pool._live.values()
    ]
    before = [_proc_cpu(p) for p in pids]
    host0 = os.times()
    await closed_loop(one, n, 1)
    host1 = os.times()
    after = [_proc_cpu(p) for p in pids]
    agent = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    program = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    host = (host1.user - host0.user) + (host1.system - host0.system)
    return {
        "program": round(program * 1000 / n, 2),
        "agent": round(agent * 1000 / n, 2),
        "host": round(host * 1000 / n, 2),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    settings = SandboxSettings(docker_pool_size=args.pool_size)
    backend = DockerBackend(settings)
    t = time.perf_counter()
    await backend.start()
    warm_s = time.perf_counter() - t
    try:

        async def one() -> None:
            r = await backend.run(PRINT1, Deadline.after(30))
            if r.run is None or r.run.stdout != "1\n":
                raise RuntimeError(f"unexpected result: {r}")

        await closed_loop(one, 20, 1)  # warm-up
        cpu = await cpu_per_run(backend, one, args.n1)
        bare_c1, docker_c1 = await interleaved(bare_python, one, args.n1, 1)
        bare_c16, docker_c16 = await interleaved(bare_python, one, args.n16, 16)
        status = backend.status()
    finally:
        await backend.close()
    exec_floor = await docker_exec_floor(settings.docker_image, args.n_exec)
    return {
        "benchmark": "sandboxd.docker_backend",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "pool_size": args.pool_size,
        "load_average_at_end": os.getloadavg(),
        "pool_warm_up_s": round(warm_s, 2),
        "bare_python": {"c1": bare_c1, "c16": bare_c16},
        "docker_exec_floor": {"c1": exec_floor},
        "docker_backend": {"c1": docker_c1, "c16": docker_c16},
        "cpu_ms_per_run": cpu,
        "ratios": {
            "p50_c1_vs_bare": round(docker_c1["p50_ms"] / bare_c1["p50_ms"], 2),
            "p50_c1_vs_docker_exec": round(docker_c1["p50_ms"] / exec_floor["p50_ms"], 2),
            "runs_per_s_c16_vs_bare": round(docker_c16["runs_per_s"] / bare_c16["runs_per_s"], 2),
        },
        "targets": {
            "p50_c1_ms_max": 40,
            "runs_per_s_c16_min": 50,
            "met": docker_c1["p50_ms"] <= 40 and docker_c16["runs_per_s"] >= 50,
        },
        "pool_status": status,
    }


def print_report(report: dict[str, Any]) -> None:
    table = Table(title=f"docker backend, print(1) (pool of {report['pool_size']})")
    for col in ("what", "concurrency", "p50 ms", "p99 ms", "runs/s"):
        table.add_column(col)
    rows = [
        ("bare /usr/bin/python3", "c1", report["bare_python"]["c1"]),
        ("docker exec (floor)", "c1", report["docker_exec_floor"]["c1"]),
        ("docker backend", "c1", report["docker_backend"]["c1"]),
        ("bare /usr/bin/python3", "c16", report["bare_python"]["c16"]),
        ("docker backend", "c16", report["docker_backend"]["c16"]),
    ]
    for what, conc, s in rows:
        table.add_row(what, conc, str(s["p50_ms"]), str(s["p99_ms"]), str(s["runs_per_s"]))
    console = Console(stderr=True)
    console.print(table)
    console.print(f"CPU ms per run: {report['cpu_ms_per_run']}")
    console.print(f"ratios: {report['ratios']}  targets met: {report['targets']['met']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=report_path, help="write the JSON report here")
    parser.add_argument("--json", action="store_true", help="print the JSON report on stdout")
    parser.add_argument("--pool-size", type=int, default=SandboxSettings().docker_pool_size)
    parser.add_argument("--n1", type=int, default=200, help="runs at concurrency 1")
    parser.add_argument("--n16", type=int, default=800, help="runs at concurrency 16")
    parser.add_argument("--n-exec", type=int, default=20, help="docker exec runs")
    args = parser.parse_args(argv)
    unwind_on_sigterm()  # the pool's containers are removed by `finally`
    report = asyncio.run(measure(args))
    print_report(report)
    if args.out:
        write_report(report, args.out)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
