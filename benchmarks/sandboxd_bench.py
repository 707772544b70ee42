"""`python -m benchmarks.sandboxd_bench --out FILE`: sandboxd against its floors, measured in the same run.

What it measures, for `print(1)` in python:
- baselines: a bare `/usr/bin/python3 -c` subprocess and a bare `bwrap --unshare-all` around it
  (p50/p99 sequentially, throughput at concurrency 16 from a thread pool);
- per backend (a real `toolenv sandboxd serve` on loopback, driven by the project's load generator
  `stress` in closed loop, callers = concurrency, keep-alive connections):
  p50/p99 at concurrency 1, throughput and p99 at concurrency 16 and 64 (and how many 429s);
- a soak of consecutive runs: p50 of the last 1,000 against the first 1,000, and the growth of the
  service's open fds and resident memory.
Everything is printed as ratios against the baselines and written as JSON to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from stress import BODY_KEY, LoadSpec, arun_load

from .harness import ServerProcess, report_path, toolenv_server, write_report

PYTHON = "/usr/bin/python3"
PROGRAM = "print(1)"
TARGETS = {
    "process": {"p50_ms": 16.0, "rps_c16": 115.0},
    "docker": {"p50_ms": 40.0, "rps_c16": 50.0},
}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(latencies_s: list[float], wall_s: float | None = None) -> dict[str, float]:
    ms = [v * 1000 for v in latencies_s]
    out = {"n": len(ms), "p50_ms": round(pct(ms, 50), 2), "p99_ms": round(pct(ms, 99), 2)}
    if wall_s:
        out["rps"] = round(len(ms) / wall_s, 1)
    return out


# ---------------------------------------------------------------- baselines


def bwrap_floor_argv() -> list[str] | None:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr"]
    for name in ("lib", "lib64", "bin"):
        p = Path("/") / name
        if p.is_symlink():
            argv += ["--symlink", os.readlink(p), str(p)]
    return [*argv, "--proc", "/proc", "--dev", "/dev", PYTHON, "-c", PROGRAM]


def time_subprocess(argv: list[str], n: int, concurrency: int) -> dict[str, float]:
    def one(_: int) -> float:
        t = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True)
        return time.perf_counter() - t

    for _ in range(3):
        one(0)
    started = time.perf_counter()
    if concurrency == 1:
        lat = [one(i) for i in range(n)]
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            lat = list(pool.map(one, range(n)))
    return summarize(lat, time.perf_counter() - started)


# ---------------------------------------------------------------- the service


def sandboxd(backend: str, extra: list[str]) -> ServerProcess:
    """A real `toolenv sandboxd serve --backend BACKEND` on loopback (not started yet)."""
    return toolenv_server(
        "sandboxd", "serve", "--backend", backend, *extra,
        ready_timeout_s=600 if backend == "docker" else 60, stop_timeout_s=30,
    )  # fmt: skip


BODY = {"code": PROGRAM, "language": "python"}


def run_succeeded(status: int, body: str | None) -> bool:
    """A 200 whose JSON says the program ran to success (sandboxd answers 200 for failed runs)."""
    if status != 200 or not body:
        return False
    try:
        return json.loads(body).get("status") == "Success"
    except ValueError:  # a prefix cut short: the status field comes first
        return '"status":"Success"' in body


async def closed_loop(url: str, concurrency: int, n: int) -> dict[str, Any]:
    """`concurrency` callers, each sending its next request when the previous one answers.

    Driven by `stress`. 429s are counted and left out of the latencies, as are their callers'
    turns.
    """
    result = await arun_load(
        LoadSpec(
            url=url + "/run_code",
            body=BODY,
            arrival="closed",
            concurrency=concurrency,
            max_requests=n,
            duration_s=3600.0,
            timeout_s=120.0,
            capture_body_bytes=4096,
            preconnect=concurrency,  # keep-alive connections open before the clock starts
        )
    )
    latencies: list[float] = []
    rejected = failed = 0
    for r in result.records:
        if r.status == 429:
            rejected += 1
            continue
        if not run_succeeded(r.status, r.headers.get(BODY_KEY)):
            failed += 1
        if r.done_s == r.done_s:  # not NaN: the request got an end
            latencies.append(r.done_s - r.scheduled_s)
    out: dict[str, Any] = summarize(latencies, result.wall_s)
    out.update({"concurrency": concurrency, "rejected_429": rejected, "failed": failed})
    out["_latencies"] = latencies
    return out


async def interleaved_c1(url: str, n: int) -> dict[str, Any]:
    """Concurrency 1, round-robin: bare python, bare bwrap, the service, so all see the same load.

    On a shared machine the load changes from minute to minute; measuring the baselines and the
    service in turn (rather than one after the other) keeps their ratio meaningful.
    """
    loop = asyncio.get_running_loop()
    floor = bwrap_floor_argv()

    def timed(argv: list[str]) -> float:
        t = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True)
        return time.perf_counter() - t

    samples: dict[str, list[float]] = {"service": [], "bare_python": [], "bwrap": []}
    for _ in range(n):
        samples["bare_python"].append(
            await loop.run_in_executor(None, timed, [PYTHON, "-c", PROGRAM])
        )
        if floor is not None:
            samples["bwrap"].append(await loop.run_in_executor(None, timed, floor))
        one = await closed_loop(url, 1, 1)
        samples["service"].extend(one["_latencies"])
    return {k: summarize(v) for k, v in samples.items() if v}


async def watch_admission(url: str, period_s: float = 0.05) -> dict[str, int]:
    """Until cancelled: the most programs seen running at once and requests seen waiting."""
    seen = {"max_running_seen": 0, "max_waiting_seen": 0}
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            while True:
                adm = (await client.get(url + "/v1/sandbox/status")).json().get("admission", {})
                seen["max_running_seen"] = max(seen["max_running_seen"], adm.get("running", 0))
                seen["max_waiting_seen"] = max(seen["max_waiting_seen"], adm.get("waiting", 0))
                await asyncio.sleep(period_s)
    except asyncio.CancelledError:
        return seen


async def measure_backend(
    backend: str, sizes: dict[str, int], extra: list[str], console: Console
) -> dict[str, Any]:
    server = sandboxd(backend, extra)
    try:
        server.start()
        console.print(f"[bold]{backend}[/]: warming up")
        await closed_loop(server.url, 4, 50)
        result: dict[str, Any] = {}
        for label, conc, n in (
            ("c1", 1, sizes["c1"]),
            ("c16", 16, sizes["c16"]),
            ("c64", 64, sizes["c64"]),
        ):
            console.print(f"  {label}: {n} runs at concurrency {conc}")
            watcher = asyncio.create_task(watch_admission(server.url))
            try:
                r = await closed_loop(server.url, conc, n)
            finally:
                watcher.cancel()
                seen = await asyncio.gather(watcher, return_exceptions=True)
            r.pop("_latencies")
            if isinstance(seen[0], dict):
                r.update(seen[0])
            result[label] = r
        console.print(f"  c1 interleaved with the baselines: {sizes['c1']} rounds")
        result["c1_interleaved"] = await interleaved_c1(server.url, sizes["c1"])
        status = httpx.get(server.url + "/v1/sandbox/status", timeout=5).json()
        result["capacity"] = status.get("admission", {}).get("capacity")
        if sizes["soak"]:
            console.print(f"  soak: {sizes['soak']} consecutive runs")
            fds0, rss0 = server.fds(), server.rss_kb()
            soak = await closed_loop(server.url, sizes["soak_concurrency"], sizes["soak"])
            lat = soak.pop("_latencies")
            k = min(1000, len(lat) // 2)
            first, last = statistics.median(lat[:k]) * 1000, statistics.median(lat[-k:]) * 1000
            fds1, rss1 = server.fds(), server.rss_kb()
            result["soak"] = {
                "runs": len(lat),
                "concurrency": sizes["soak_concurrency"],
                "window": k,
                "p50_first_ms": round(first, 2),
                "p50_last_ms": round(last, 2),
                "p50_last_over_first": round(last / first, 3),
                "fds_start": fds0,
                "fds_end": fds1,
                "fds_growth": round(fds1 / fds0 - 1, 3),
                "rss_kb_start": rss0,
                "rss_kb_end": rss1,
                "rss_growth": round(rss1 / rss0 - 1, 3),
                "failed": soak["failed"],
                "rps": soak["rps"],
            }
        return result
    except Exception as exc:  # a backend that cannot start is reported, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        server.stop()


def docker_available() -> bool:
    if (
        importlib.util.find_spec("sandboxd.docker_backend") is None
        or shutil.which("docker") is None
    ):
        return False
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def ratios(report: dict[str, Any]) -> dict[str, Any]:
    base = report["baselines"]
    out: dict[str, Any] = {}
    for backend, r in report["backends"].items():
        if "error" in r:
            continue
        target = TARGETS.get(backend, {})
        c1, c16, c64 = r["c1"], r["c16"], r["c64"]
        entry = {
            "p50_over_bare_python": round(c1["p50_ms"] / base["bare_python_c1"]["p50_ms"], 2),
            "c64_rps_over_c16_rps": round(c64["rps"] / c16["rps"], 3),
            "p50_target_ms": target.get("p50_ms"),
            "p50_meets_target": c1["p50_ms"] <= target.get("p50_ms", float("inf")),
            "rps_c16_target": target.get("rps_c16"),
            "rps_c16_meets_target": c16["rps"] >= target.get("rps_c16", 0),
            "c64_within_10pct_of_c16": c64["rps"] >= 0.9 * c16["rps"],
        }
        if "bwrap_c1" in base:
            entry["p50_over_bwrap_floor"] = round(c1["p50_ms"] / base["bwrap_c1"]["p50_ms"], 2)
            entry["rps_c16_over_bwrap_floor"] = round(c16["rps"] / base["bwrap_c16"]["rps"], 2)
        if "c1_interleaved" in r:
            il = r["c1_interleaved"]
            entry["interleaved_p50_ms"] = il["service"]["p50_ms"]
            entry["interleaved_p50_over_bare_python"] = round(
                il["service"]["p50_ms"] / il["bare_python"]["p50_ms"], 2
            )
            if "bwrap" in il:
                entry["interleaved_p50_over_bwrap_floor"] = round(
                    il["service"]["p50_ms"] / il["bwrap"]["p50_ms"], 2
                )
        if "soak" in r:
            s = r["soak"]
            entry["soak_ok"] = (
                s["p50_last_over_first"] <= 1.1 and s["fds_growth"] < 0.1 and s["rss_growth"] < 0.1
            )
        out[backend] = entry
    return out


def print_report(report: dict[str, Any], console: Console) -> None:
    t = Table(title="sandboxd: print(1) in python", title_justify="left")
    for col in ("what", "p50 ms", "p99 ms", "runs/s", "429s", "max running"):
        t.add_column(col)
    for name, b in report["baselines"].items():
        t.add_row(
            f"baseline {name}", str(b["p50_ms"]), str(b["p99_ms"]), str(b.get("rps", "")), "", ""
        )
    for backend, r in report["backends"].items():
        if "error" in r:
            t.add_row(backend, "error", r["error"][:60], "", "", "")
            continue
        if "c1_interleaved" in r:
            for name, x in r["c1_interleaved"].items():
                t.add_row(
                    f"{backend} c1 interleaved: {name}",
                    str(x["p50_ms"]),
                    str(x["p99_ms"]),
                    "",
                    "",
                    "",
                )
        for label in ("c1", "c16", "c64"):
            x = r[label]
            t.add_row(
                f"{backend} {label}",
                str(x["p50_ms"]),
                str(x["p99_ms"]),
                str(x["rps"]),
                str(x["rejected_429"]),
                f"{x.get('max_running_seen', '?')} of {r.get('capacity')}",
            )
    console.print(t)
    for backend, r in report["backends"].items():
        if "soak" in r:
            console.print(f"{backend} soak: {json.dumps(r['soak'])}")
    console.print_json(json.dumps(report["ratios"]))


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    console = Console(stderr=True)
    quick = args.quick
    sizes = {
        "c1": 60 if quick else 300,
        "c16": 300 if quick else 2000,
        "c64": 400 if quick else 2000,
        "soak": args.soak if args.soak is not None else (1000 if quick else 10_000),
        "soak_concurrency": args.soak_concurrency,
    }
    backends = (
        args.backends.split(",")
        if args.backends
        else (["process", "docker"] if docker_available() else ["process"])
    )
    console.print("baselines: bare python, bare bwrap + python")
    n_base = 60 if quick else 300
    baselines: dict[str, Any] = {
        "bare_python_c1": time_subprocess([PYTHON, "-c", PROGRAM], n_base, 1),
        "bare_python_c16": time_subprocess([PYTHON, "-c", PROGRAM], 4 * n_base, 16),
    }
    if (floor := bwrap_floor_argv()) is not None:
        baselines["bwrap_c1"] = time_subprocess(floor, n_base, 1)
        baselines["bwrap_c16"] = time_subprocess(floor, 4 * n_base, 16)
    extra = ["--max-concurrency", str(args.max_concurrency)] if args.max_concurrency else []
    report: dict[str, Any] = {
        "benchmark": "sandboxd",
        "program": f"python: {PROGRAM}",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_at_start": os.getloadavg(),
        },
        "sizes": sizes,
        "baselines": baselines,
        "backends": {},
    }
    for backend in backends:
        report["backends"][backend] = await measure_backend(backend, sizes, extra, console)
    report["machine"]["load_avg_at_end"] = os.getloadavg()
    report["ratios"] = ratios(report)
    print_report(report, console)
    return report


BACKENDS = ("process", "docker")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--out", type=report_path, default=Path("bench-results/benchmarks.sandboxd_bench.json")
    )
    parser.add_argument("--quick", action="store_true", help="small counts (about a minute)")
    parser.add_argument(
        "--backends", help="comma-separated (default: process, plus docker if usable)"
    )
    parser.add_argument("--soak", type=int, help="consecutive runs in the soak (0: skip)")
    parser.add_argument("--soak-concurrency", type=int, default=1)
    parser.add_argument(
        "--max-concurrency", type=int, default=0, help="server setting (0: default)"
    )
    args = parser.parse_args(argv)
    unknown = set((args.backends or "process").split(",")) - set(BACKENDS)
    if unknown:  # it ran the baselines first, then reported each unknown one as failing
        parser.error(
            f"argument --backends: no backend {', '.join(sorted(unknown))} (of {', '.join(BACKENDS)})"
        )
    report = asyncio.run(amain(args))
    write_report(report, args.out)
    failed = [b for b, r in report["backends"].items() if "error" in r]
    return 1 if failed and len(failed) == len(report["backends"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
