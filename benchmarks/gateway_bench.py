"""Gateway overhead: the same zero-delay search emulator called directly and through the gateway.

    python -m benchmarks.gateway_bench --out bench-results/benchmarks.gateway_bench.json [--quick]
        [--rates 500,2000,4000] [--no-pin] [--nice -10]

Three processes on loopback: the emulator (`toolenv emulators serve`, a constant 0 s profile),
the gateway in proxy mode in front of it (`toolenv gateway serve`, trace capture on), and the
open-loop load generator (`stress`, latency measured from each request's scheduled send time, so
stalls are not hidden). Every request carries a deadline and the trajectory, step and turn
headers, so the gateway's deadline, admission, metrics and trace capture all run. With two or
more CPUs the gateway is pinned alone to the last one (taskset) and the emulator and generator to
the others: "one gateway process on one core". Rounds alternate direct, through the gateway
(`/retrieve`, pass-through) and the generic call (`/v1/tools/search/call`) at each rate, so drift
on a shared machine hits all alike. Added = gateway minus direct at each percentile; ratio =
gateway over direct (the baseline measured in the same run). Each route's direct baseline is the
emulator endpoint it reaches: `/retrieve` for the pass-through route, the native
`/v1/emulators/search/call` for the generic call (about 15% more of the emulator's CPU per call). CPU per call = the process's CPU
time (/proc) over the calls it served in that window; its baseline is the floor proxy
(`benchmarks/floor_proxy.py`: uvloop, httptools and the same upstream client, nothing else), run
in the same rounds on the gateway's CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from stress import LoadSpec, run_load
from toolenv_core import headers as h

from .harness import (
    ServerProcess,
    free_port,
    positive_float,
    report_path,
    toolenv_server,
    write_report,
)

BODY = {"queries": ["who wrote hamlet"], "topk": 3}
HEADERS = {h.DEADLINE: "10000", h.TRAJECTORY: "bench-trajectory", h.STEP: "3", h.TURN: "1"}
PERCENTILES = (50, 90, 99, 99.9)
PATHS = {"gateway": ("/retrieve", BODY), "generic": ("/v1/tools/search/call", {"arguments": BODY})}
# Each direct baseline calls the emulator endpoint its route reaches: the pass-through route the
# emulator's `/retrieve`, the generic call the tool's native endpoint (a costlier route of the
# emulator, on the generator's CPU), so "added" is what the gateway itself adds.
DIRECT = {"direct": ("/retrieve", BODY), "direct_native": ("/v1/emulators/search/call", BODY)}
BASELINE_OF = {"floor": "direct", "gateway": "direct", "generic": "direct_native"}
TARGET = {"rate_rps": 4000, "gateway_cpu_us_per_call": 100.0, "added_p99_ms": 5.0}


def _cpu_split(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(gateway CPUs, everything else's CPUs): the last CPU for the gateway alone."""
    cpus = sorted(os.sched_getaffinity(0))
    if not pin or len(cpus) < 2:
        return None, None
    return {cpus[-1]}, set(cpus[:-1])


def _start(workdir: Path, pin: bool) -> tuple[ServerProcess, ServerProcess, ServerProcess]:
    """The emulator, the gateway in front of it, and the floor proxy (benchmarks/floor_proxy.py)
    in front of it on the gateway's CPU."""
    gateway_cpus, other_cpus = _cpu_split(pin)
    if other_cpus is not None:
        os.sched_setaffinity(0, other_cpus)  # the load generator (this process)
    emu_cfg = workdir / "emulators.yaml"
    emu_cfg.write_text(
        yaml.safe_dump(
            {
                "emulators": {
                    "log_level": "warning",
                    "search_profile": {
                        "tool": "search",
                        "model": {"kind": "constant", "value_s": 0.0},
                    },
                }
            }
        )
    )
    emulator = toolenv_server("emulators", "serve", "--config", str(emu_cfg), cpus=other_cpus)
    emulator.start()
    gw_cfg = workdir / "gateway.yaml"
    gw_cfg.write_text(
        yaml.safe_dump(
            {
                "gateway": {
                    "log_level": "warning",
                    "trace_path": str(workdir / "capture.jsonl"),
                    "tools": [
                        {
                            "name": "search",
                            "kind": "search",
                            "mode": "proxy",
                            "upstreams": [emulator.url],
                            "concurrency": 1024,
                            "queue": 8192,
                        }
                    ],
                }
            }
        )
    )
    started = [emulator]
    try:
        gateway = toolenv_server("gateway", "serve", "--config", str(gw_cfg), cpus=gateway_cpus)
        started.append(gateway.start())
        port = free_port()
        argv = [sys.executable, str(Path(__file__).with_name("floor_proxy.py")), emulator.url]
        if gateway_cpus is not None:
            argv = ["taskset", "-c", ",".join(map(str, sorted(gateway_cpus))), *argv]
        floor = ServerProcess([*argv, str(port)], port).start()
    except BaseException:  # Ctrl-C too: each runs in its own session
        for server in started:
            server.stop()
        raise
    return emulator, gateway, floor


def _percentiles(latencies_ms: np.ndarray) -> dict[str, float]:
    if latencies_ms.size == 0:
        return {f"p{p:g}": float("nan") for p in PERCENTILES}
    return {f"p{p:g}": float(np.percentile(latencies_ms, p)) for p in PERCENTILES}


def _run(
    url: str, rate: float, duration_s: float, path: str = "/retrieve", body: Any = None
) -> dict[str, Any]:
    result = run_load(
        LoadSpec(
            url=url + path,
            body=BODY if body is None else body,
            headers=HEADERS,
            rate=rate,
            duration_s=duration_s,
            arrival="constant",
            max_in_flight=5000,
            connections=256,
            timeout_s=30,
            seed=1,
        )
    )
    ok = result.latencies_ms("ok", corrected=True)
    return {
        "sent": int(result.n),
        "ok": int(ok.size),
        "achieved_rps": round(float(result.achieved_rate), 1),
        "latency_ms": _percentiles(ok),
        "_ok": ok,
    }


def measure(rates: list[float], duration_s: float, rounds: int, pin: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="toolenv-gw-bench-") as tmp:
        emulator, gateway, floor = _start(Path(tmp), pin)
        try:
            # warm every path (connections, caches) before measuring
            for path, body in DIRECT.values():
                _run(emulator.url, 200, 1.0, path, body)
            _run(floor.url, 200, 1.0)
            for path, body in PATHS.values():
                _run(gateway.url, 200, 1.0, path, body)
            report: dict[str, Any] = {}
            names = [*DIRECT, "floor", *PATHS]
            for rate in rates:
                samples: dict[str, list[np.ndarray]] = {k: [] for k in names}
                cpu = dict.fromkeys(names, 0.0)
                # the other CPU's two tenants in each round: the generator (this process, which
                # polls the last half millisecond before each send) and the emulator (every
                # route ends there)
                generator_cpu = dict.fromkeys(names, 0.0)
                emulator_cpu = dict.fromkeys(names, 0.0)
                calls = dict.fromkeys(names, 0)
                runs: list[dict[str, Any]] = []
                for _ in range(rounds):
                    one: dict[str, dict[str, Any]] = {}
                    for name in names:
                        server = floor if name == "floor" else gateway
                        path, body = PATHS.get(name, ("/retrieve", BODY))
                        if name in DIRECT:
                            server, (path, body) = emulator, DIRECT[name]
                        c0, e0, g0 = server.cpu_s(), emulator.cpu_s(), time.process_time()
                        one[name] = _run(server.url, rate, duration_s, path, body)
                        cpu[name] += server.cpu_s() - c0
                        generator_cpu[name] += time.process_time() - g0
                        emulator_cpu[name] += emulator.cpu_s() - e0
                    for name, r in one.items():
                        calls[name] += r["sent"]
                        samples[name].append(r.pop("_ok"))
                    runs.append({**one, "loadavg_1m": os.getloadavg()[0]})
                pct = {k: _percentiles(np.concatenate(v)) for k, v in samples.items()}
                entry: dict[str, Any] = {f"{name}_ms": pct[name] for name in DIRECT}
                for name in ["floor", *PATHS]:
                    gp, dp = pct[name], pct[BASELINE_OF[name]]
                    entry[f"{name}_ms"] = gp
                    entry[f"{name}_added_ms"] = {k: gp[k] - dp[k] for k in dp}
                    entry[f"{name}_ratio_over_direct"] = {
                        k: gp[k] / dp[k] if dp[k] else None for k in dp
                    }
                # CPU per call does not depend on how busy the machine is as much as latency does;
                # the floor proxy, measured in the same run on the same CPU, says what it is now
                per_call = {name: 1e6 * cpu[name] / max(1, calls[name]) for name in names}
                entry["cpu_us_per_call"] = {
                    "emulator (baseline)": per_call["direct"],
                    "emulator, native endpoint": per_call["direct_native"],
                    "floor proxy (baseline)": per_call["floor"],
                    **{name: per_call[name] for name in PATHS},
                }
                entry["generator_cpu_us_per_call"] = {
                    name: 1e6 * generator_cpu[name] / max(1, calls[name]) for name in names
                }
                entry["emulator_cpu_us_per_call"] = {
                    name: 1e6 * emulator_cpu[name] / max(1, calls[name]) for name in names
                }
                entry["cpu_ratio_over_floor"] = {
                    name: per_call[name] / per_call["floor"] if per_call["floor"] else None
                    for name in PATHS
                }
                entry["achieved_rps"] = {
                    name: round(sum(r[name]["achieved_rps"] for r in runs) / len(runs), 1)
                    for name in names
                }
                entry["ok_fraction"] = {
                    name: sum(r[name]["ok"] for r in runs) / max(1, calls[name]) for name in names
                }
                entry["rounds"] = runs
                report[f"{rate:g}rps"] = entry
            return report
        finally:
            for server in (floor, gateway, emulator):
                server.stop()


def _verdict(results: dict[str, Any]) -> dict[str, Any] | None:
    """The issue's target at its rate: gateway CPU per call and added p99, every call answered."""
    entry = results.get(f"{TARGET['rate_rps']:g}rps")
    if entry is None:
        return None
    out: dict[str, Any] = {}
    for name in PATHS:
        cpu = entry["cpu_us_per_call"][name]
        added = entry[f"{name}_added_ms"]["p99"]
        sustained = (
            entry["ok_fraction"][name] == 1.0
            and entry["achieved_rps"][name] >= 0.97 * (TARGET["rate_rps"])
        )
        out[name] = {
            "cpu_us_per_call": round(cpu, 1),
            "added_p99_ms": round(added, 3),
            "sustained": sustained,
            "met": sustained
            and cpu <= TARGET["gateway_cpu_us_per_call"]
            and added <= TARGET["added_p99_ms"],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=report_path, default=Path("bench-results/benchmarks.gateway_bench.json")
    )
    parser.add_argument("--quick", action="store_true", help="short runs (a smoke test, noisy)")
    parser.add_argument("--rates", default="500,2000,4000")
    parser.add_argument(
        "--no-pin", action="store_true", help="leave every process free to use every CPU"
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="niceness increment for the bench and its servers (negative, as root: less disturbed "
        "by other work on a shared machine; the report records it)",
    )
    args = parser.parse_args(argv)
    try:
        rates = [positive_float(r) for r in args.rates.split(",")]
    except argparse.ArgumentTypeError as exc:
        parser.error(f"argument --rates: {exc}")
    if args.nice:
        os.nice(args.nice)  # inherited by the emulator and gateway processes started below
    duration, rounds = (3.0, 1) if args.quick else (10.0, 3)
    gateway_cpus, other_cpus = _cpu_split(not args.no_pin)
    started = time.monotonic()
    load_at_start = os.getloadavg()[0]
    results = measure(rates, duration, rounds, not args.no_pin)
    report = {
        "benchmark": "gateway overhead and CPU per call (proxy mode, zero-delay search emulator; "
        "/retrieve pass-through and the generic call)",
        "command": "python -m benchmarks.gateway_bench --out FILE"
        + (" --quick" if args.quick else "")
        + (f" --rates {args.rates}" if args.rates != "500,2000,4000" else "")
        + (" --no-pin" if args.no_pin else "")
        + (f" --nice {args.nice}" if args.nice else ""),
        "duration_s_per_run": duration,
        "rounds": rounds,
        "cpus": os.cpu_count(),
        "gateway_cpus": sorted(gateway_cpus) if gateway_cpus else None,
        "emulator_and_generator_cpus": sorted(other_cpus) if other_cpus else None,
        "loadavg_1m_at_start": load_at_start,
        "loadavg_1m_at_end": os.getloadavg()[0],
        "niceness": os.nice(0),
        "target": TARGET,
        "verdict": _verdict(results),
        "results": results,
        "seconds": round(time.monotonic() - started, 1),
    }
    write_report(report, args.out)
    _print(report)
    print(f"wrote {args.out}")
    return 0


def _print(report: dict[str, Any]) -> None:
    results = report["results"]
    print(f"{'rate':>8} {'path':>8} {'pct':>6} {'direct ms':>10} {'via it ms':>10} {'added ms':>9}")
    for rate, r in results.items():
        for name in ["floor", *PATHS]:
            direct = r[f"{BASELINE_OF[name]}_ms"]
            for k in direct:
                print(
                    f"{rate:>8} {name:>8} {k:>6} {direct[k]:>10.3f} "
                    f"{r[f'{name}_ms'][k]:>10.3f} {r[f'{name}_added_ms'][k]:>9.3f}"
                )
    for rate, r in results.items():
        cpu, got = r["cpu_us_per_call"], r["achieved_rps"]
        floor = cpu["floor proxy (baseline)"]
        print(
            f"{rate:>8} CPU per call: pass-through {cpu['gateway']:.0f} us, generic "
            f"{cpu['generic']:.0f} us; floor proxy {floor:.0f} us (ratios "
            f"{r['cpu_ratio_over_floor']['gateway']:.2f} / {r['cpu_ratio_over_floor']['generic']:.2f}), "
            f"emulator {cpu['emulator (baseline)']:.0f} us (native endpoint "
            f"{cpu['emulator, native endpoint']:.0f} us); achieved rps direct {got['direct']}, "
            f"floor {got['floor']}, gateway {got['gateway']} / {got['generic']}"
        )
        gen, emu = r["generator_cpu_us_per_call"], r["emulator_cpu_us_per_call"]
        print(
            f"{rate:>8} the other CPU per call: generator (it polls what the emulator leaves) "
            + ", ".join(f"{name} {gen[name]:.0f}" for name in gen)
            + " us; emulator "
            + ", ".join(f"{name} {emu[name]:.0f}" for name in emu)
            + " us"
        )
    if report["verdict"]:
        print(f"target {report['target']}: {json.dumps(report['verdict'])}")
    print(
        f"gateway on CPUs {report['gateway_cpus']}, the rest on {report['emulator_and_generator_cpus']}; "
        f"load average (1 min) {report['loadavg_1m_at_start']:.1f} -> "
        f"{report['loadavg_1m_at_end']:.1f} on {report['cpus']} CPUs"
    )


if __name__ == "__main__":
    raise SystemExit(main())
