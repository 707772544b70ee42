"""Bench: how fast can the generator drive load on ONE core, and how honestly does it keep time?

    python -m benchmarks.stress_bench --out FILE [--quick]

A zero-delay endpoint (uvicorn + httptools, raw ASGI) runs in another process pinned to CPU 1;
the generator runs here pinned to CPU 0. Open-loop steps at rising rates: a step is *sustained*
when the achieved rate is >= 97% of the target, nothing failed or was dropped, and the
generator's own scheduling error (hand-over to the client - scheduled send) has p99 <= 2 ms. The ceiling is
the highest sustained rate (a step that misses is tried once more, best of two, because other
load on a shared machine only ever makes it worse). The baseline is an httpx AsyncClient driven
open loop the same way in the same run (plus both clients' closed-loop maximum and CPU cost per
request at 1, 8 and 64 callers, the baseline taking httpx's best); figures are ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from typing import Any

import httpx
import numpy as np

from stress import LoadSpec, run_load

from .harness import ServerProcess, free_port, report_path, write_report

SCHED_P99_LIMIT_MS = 2.0
SPIN_S = 0.001  # the CLI's --precise: poll for the last 1 ms before a send instead of a timer
HTTPX_OPEN_LOOP_CONNECTIONS = 8  # httpx does best at few connections here (see closed-loop sweep)
ACHIEVED_SHARE = 0.97


def _pin(cpu: int) -> bool:
    if hasattr(os, "sched_setaffinity") and cpu in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {cpu})
        return True
    return False


def _step_verdict(
    rate: float, n: int, ok: int, achieved: float, sched_p99: float, lat: np.ndarray
) -> dict[str, Any]:
    sustained = ok == n and achieved >= ACHIEVED_SHARE * rate and sched_p99 <= SCHED_P99_LIMIT_MS
    return {
        "target_rps": rate,
        "achieved_rps": round(achieved, 1),
        "requests": n,
        "ok": ok,
        "sched_error_p99_ms": round(sched_p99, 3),
        "latency_p50_ms": round(float(np.percentile(lat, 50)), 3) if len(lat) else None,
        "latency_p99_ms": round(float(np.percentile(lat, 99)), 3) if len(lat) else None,
        "sustained": bool(sustained),
    }


def ours_step(url: str, rate: float, duration_s: float) -> dict[str, Any]:
    spec = LoadSpec(
        url=url,
        body={"q": 1},
        rate=rate,
        duration_s=duration_s,
        timeout_s=5,
        spin_s=SPIN_S,
        # a zero-delay endpoint needs a handful of connections; a cap keeps a server hiccup
        # (from other load on the machine) from turning into a connect storm in the generator
        connections=64,
        preconnect=32,
    )
    result = run_load(spec)
    s = result.summary()
    ok = s["outcomes"].get("ok", {}).get("count", 0)
    step = _step_verdict(
        rate,
        result.n,
        ok,
        s["achieved_rate"],
        s["scheduling_error_ms"]["p99"],
        result.latencies_ms(),
    )
    step["send_lag_p99_ms"] = round(s["send_lag_ms"]["p99"], 3)  # incl. waits for a connection
    return step


def ours_closed(url: str, duration_s: float, concurrency: int = 64) -> tuple[float, float]:
    """Closed-loop throughput and the generator's CPU microseconds per request."""
    cpu0 = time.process_time()
    result = run_load(
        LoadSpec(
            url=url, body={"q": 1}, arrival="closed", concurrency=concurrency, duration_s=duration_s
        )
    )
    cpu_us = (time.process_time() - cpu0) * 1e6 / max(1, result.n)
    return result.summary()["achieved_rate"], cpu_us


async def _httpx_open(url: str, rate: float, duration_s: float) -> dict[str, Any]:

    n = int(rate * duration_s)
    sched = np.full(n, np.nan)
    sent = np.full(n, np.nan)
    done = np.full(n, np.nan)
    ok = 0
    c = HTTPX_OPEN_LOOP_CONNECTIONS
    limits = httpx.Limits(max_connections=c, max_keepalive_connections=c)
    async with httpx.AsyncClient(limits=limits, timeout=5.0, trust_env=False) as client:

        async def one(i: int) -> None:
            nonlocal ok
            sent[i] = time.monotonic()
            try:
                r = await client.post(url, json={"q": 1})
                ok += r.status_code == 200
            except httpx.HTTPError:
                pass
            done[i] = time.monotonic()

        start = time.monotonic() + 0.01
        sched[:] = start + np.arange(n) / rate
        tasks = []
        i = 0
        give_up = (
            start + 2 * duration_s + 5.0
        )  # httpx can fall so far behind that a step never ends
        while i < n and time.monotonic() < give_up:
            now = time.monotonic()
            while i < n and sched[i] <= now:
                tasks.append(asyncio.create_task(one(i)))
                i += 1
            if i < n:
                await asyncio.sleep(max(0.0, sched[i] - time.monotonic()))
        await asyncio.wait(tasks, timeout=10)
    finished = ~np.isnan(done)
    wall = max(float(np.nanmax(done) - start) if finished.any() else 0.0, duration_s)
    lag = (sent - sched)[~np.isnan(sent)] * 1000
    lat = ((done - sched) * 1000)[finished]
    return _step_verdict(
        rate, n, ok, ok / wall, float(np.percentile(lag, 99)) if len(lag) else 1e9, lat
    )


async def _httpx_closed(url: str, duration_s: float, concurrency: int = 64) -> tuple[float, float]:

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    count = 0
    async with httpx.AsyncClient(limits=limits, timeout=5.0, trust_env=False) as client:
        end = time.monotonic() + duration_s

        async def caller() -> None:
            nonlocal count
            while time.monotonic() < end:
                r = await client.post(url, json={"q": 1})
                count += r.status_code == 200

        start, cpu0 = time.monotonic(), time.process_time()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        cpu_us = (time.process_time() - cpu0) * 1e6 / max(1, count)
        return count / (time.monotonic() - start), cpu_us


def httpx_step(url: str, rate: float, duration_s: float) -> dict[str, Any]:
    return asyncio.run(_httpx_open(url, rate, duration_s))


def _ceiling_said(rps: float | None) -> str:
    """A ceiling for the summary line ("None rps" when no step held its rate)."""
    return f"{rps:g} rps" if rps else "none (no rate tried held its schedule)"


def ceiling(steps: list[dict[str, Any]]) -> float | None:
    ok = [s["target_rps"] for s in steps if s["sustained"]]
    return max(ok) if ok else None


def climb(
    step_fn: Any,
    url: str,
    rates: list[float],
    duration_s: float,
    label: str,
    must_reach: float = 0.0,
) -> list[dict[str, Any]]:
    """Run steps in order; stop after two unsustained steps in a row (the ceiling is behind us),
    but not before `must_reach` (the rate the target is stated at)."""
    steps, misses = [], 0
    for rate in rates:
        step = step_fn(url, rate, duration_s)
        if not step["sustained"]:  # other load on the machine only ever hurts: best of two
            again = step_fn(url, rate, duration_s)
            again["attempt"] = 2
            if again["sustained"] or again["sched_error_p99_ms"] < step["sched_error_p99_ms"]:
                step = again
        steps.append(step)
        print(
            f"  {label:6s} {rate:>7.0f} rps: achieved {step['achieved_rps']:>8.1f}, "
            f"sched err p99 {step['sched_error_p99_ms']:.2f} ms, p99 {step['latency_p99_ms']} ms, "
            f"{'sustained' if step['sustained'] else 'NOT sustained'}",
            flush=True,
        )
        misses = 0 if step["sustained"] else misses + 1
        if misses >= 2 and rate >= must_reach:
            break
    return steps


def zero_server(cpu: int | None) -> ServerProcess:
    """The stress package's zero-delay test server (`python -m stress.testing`), optionally
    pinned to one CPU so that it never shares a core with the generator."""
    port = free_port()
    argv = [sys.executable, "-m", "stress.testing", "--kind", "zero", "--port", str(port)]
    return ServerProcess(argv + (["--cpu", str(cpu)] if cpu is not None else []), port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="toolenv stress generator bench")
    parser.add_argument("--out", type=report_path, required=True)
    parser.add_argument("--quick", action="store_true", help="shorter steps (about 40 s in all)")
    args = parser.parse_args(argv)
    step_s = 2.0 if args.quick else 5.0
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    server_cpu = 1 if ncpu >= 2 else None
    pinned = _pin(0) if server_cpu is not None else False
    ours_rates = [1000, 2000, 3000, 4000, 5000, 6000, 8000, 10000, 12000]
    httpx_rates = [250, 500, 750, 1000, 1500, 2000, 3000]
    report: dict[str, Any] = {
        "machine": {
            "cpus": ncpu,
            "python": platform.python_version(),
            "generator_pinned_cpu0": pinned,
            "load_average_before": os.getloadavg(),
        },
        "criteria": {
            "achieved_share": ACHIEVED_SHARE,
            "sched_error_p99_ms": SCHED_P99_LIMIT_MS,
            "step_seconds": step_s,
        },
    }
    with zero_server(server_cpu) as server:
        url = server.url + "/bench"
        run_load(LoadSpec(url=url, rate=500, duration_s=0.5))  # warm both sides up
        print("open loop, toolenv stress client (1 process, 1 core):", flush=True)
        ours = climb(ours_step, url, ours_rates, step_s, "ours", must_reach=3000)
        print(
            f"open loop, httpx AsyncClient baseline ({HTTPX_OPEN_LOOP_CONNECTIONS} connections):",
            flush=True,
        )
        base_steps = climb(httpx_step, url, httpx_rates, step_s, "httpx")
        print("closed loop maximum throughput (callers = connections):", flush=True)
        closed: dict[str, dict[int, float]] = {"ours": {}, "httpx": {}}
        cpu_us: dict[str, dict[int, float]] = {"ours": {}, "httpx": {}}
        for callers in (1, 8, 64):
            rate_o, cpu_o = ours_closed(url, step_s / 2, callers)
            rate_h, cpu_h = asyncio.run(_httpx_closed(url, step_s / 2, callers))
            closed["ours"][callers], cpu_us["ours"][callers] = round(rate_o, 1), round(cpu_o, 1)
            closed["httpx"][callers], cpu_us["httpx"][callers] = round(rate_h, 1), round(cpu_h, 1)
            print(
                f"  {callers:>2} callers: ours {rate_o:.0f} rps ({cpu_o:.0f} us CPU/request), "
                f"httpx {rate_h:.0f} rps ({cpu_h:.0f} us CPU/request)",
                flush=True,
            )
        ours_max, httpx_max = max(closed["ours"].values()), max(closed["httpx"].values())
        ours_cpu, httpx_cpu = min(cpu_us["ours"].values()), min(cpu_us["httpx"].values())
    report["machine"]["load_average_after"] = os.getloadavg()
    at_3000 = next((s for s in ours if s["target_rps"] == 3000), None)
    ours_ceiling, httpx_ceiling = ceiling(ours), ceiling(base_steps)
    report.update(
        {
            "ours_open_loop_steps": ours,
            "httpx_open_loop_steps": base_steps,
            "ours_ceiling_rps": ours_ceiling,
            "httpx_ceiling_rps": httpx_ceiling,
            "ceiling_ratio_vs_httpx": (
                round(ours_ceiling / httpx_ceiling, 2) if ours_ceiling and httpx_ceiling else None
            ),
            "at_3000_rps": at_3000,
            "sustains_3000_rps_with_sched_p99_le_2ms": bool(at_3000 and at_3000["sustained"]),
            "closed_loop_rps_by_callers": closed,
            "cpu_us_per_request_by_callers": cpu_us,
            # CPU cost is robust to other load on the machine: 1e6 / cost = one core's ceiling
            "ours_cpu_us_per_request": ours_cpu,
            "httpx_cpu_us_per_request": httpx_cpu,
            "ours_one_core_ceiling_from_cpu_rps": round(1e6 / ours_cpu) if ours_cpu else None,
            "cpu_cost_ratio_httpx_over_ours": round(httpx_cpu / ours_cpu, 1) if ours_cpu else None,
            "ours_closed_loop_max_rps": round(ours_max, 1),
            "httpx_closed_loop_max_rps": round(httpx_max, 1),
            "closed_loop_ratio_vs_httpx": round(ours_max / httpx_max, 2) if httpx_max else None,
        }
    )
    write_report(report, args.out)
    ratio = report["ceiling_ratio_vs_httpx"]
    print(
        f"ceiling: ours {_ceiling_said(ours_ceiling)} vs httpx {_ceiling_said(httpx_ceiling)}"
        f"{f' (x{ratio})' if ratio else ''}; at 3000 rps: {at_3000}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
