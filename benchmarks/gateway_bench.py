"""Gateway overhead: the same zero-delay search emulator called directly and through the gateway.

    python -m benchmarks.gateway_bench --out bench-results/benchmarks.gateway_bench.json [--quick]

Three processes on loopback: the emulator (`toolenv emulators serve`, a constant 0 s profile),
the gateway in proxy mode in front of it (`toolenv gateway serve --mode proxy`), and the open-loop
load generator (`stress`, latency measured from each request's scheduled send
time, so stalls are not hidden). Rounds alternate direct and gateway at each rate, so drift on a
shared machine hits both alike. The added latency is gateway minus direct at each percentile;
the ratio is gateway over direct (the baseline measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from stress import LoadSpec, run_load

from .harness import ServerProcess, toolenv_server

BODY = {"queries": ["who wrote hamlet"], "topk": 3}
PERCENTILES = (50, 90, 99, 99.9)


def _start(workdir: Path) -> tuple[ServerProcess, ServerProcess]:
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
    emulator = toolenv_server("emulators", "serve", "--config", str(emu_cfg)).start()
    gw_cfg = workdir / "gateway.yaml"
    gw_cfg.write_text(
        yaml.safe_dump(
            {
                "gateway": {
                    "log_level": "warning",
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
    try:
        gateway = toolenv_server("gateway", "serve", "--config", str(gw_cfg)).start()
    except Exception:
        emulator.stop()
        raise
    return emulator, gateway


def _percentiles(latencies_ms: np.ndarray) -> dict[str, float]:
    if latencies_ms.size == 0:
        return {f"p{p:g}": float("nan") for p in PERCENTILES}
    return {f"p{p:g}": float(np.percentile(latencies_ms, p)) for p in PERCENTILES}


def _run(url: str, rate: float, duration_s: float) -> dict[str, Any]:
    result = run_load(
        LoadSpec(
            url=url + "/retrieve",
            body=BODY,
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


def measure(rates: list[float], duration_s: float, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="toolenv-gw-bench-") as tmp:
        emulator, gateway = _start(Path(tmp))
        try:
            # warm both paths (connections, caches) before measuring
            _run(emulator.url, 200, 1.0)
            _run(gateway.url, 200, 1.0)
            report: dict[str, Any] = {}
            for rate in rates:
                direct: list[np.ndarray] = []
                through: list[np.ndarray] = []
                runs: list[dict[str, Any]] = []
                cpu = {"emulator_direct": 0.0, "emulator_via_gateway": 0.0, "gateway": 0.0}
                calls = {"direct": 0, "gateway": 0}
                for _ in range(rounds):
                    e0 = emulator.cpu_s()
                    d = _run(emulator.url, rate, duration_s)
                    e1, g1 = emulator.cpu_s(), gateway.cpu_s()
                    g = _run(gateway.url, rate, duration_s)
                    e2, g2 = emulator.cpu_s(), gateway.cpu_s()
                    cpu["emulator_direct"] += e1 - e0
                    cpu["emulator_via_gateway"] += e2 - e1
                    cpu["gateway"] += g2 - g1
                    calls["direct"] += d["sent"]
                    calls["gateway"] += g["sent"]
                    direct.append(d.pop("_ok"))
                    through.append(g.pop("_ok"))
                    runs.append({"direct": d, "gateway": g, "loadavg_1m": os.getloadavg()[0]})
                dp = _percentiles(np.concatenate(direct))
                gp = _percentiles(np.concatenate(through))
                report[f"{rate:g}rps"] = {
                    "direct_ms": dp,
                    "gateway_ms": gp,
                    "added_ms": {k: gp[k] - dp[k] for k in dp},
                    "ratio_gateway_over_direct": {k: gp[k] / dp[k] if dp[k] else None for k in dp},
                    # CPU per call does not depend on how busy the machine is: the steadier figure
                    "cpu_us_per_call": {
                        "emulator (baseline)": 1e6
                        * cpu["emulator_direct"]
                        / max(1, calls["direct"]),
                        "gateway": 1e6 * cpu["gateway"] / max(1, calls["gateway"]),
                    },
                    "rounds": runs,
                }
            return report
        finally:
            gateway.stop()
            emulator.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="short runs (a smoke test, noisy)")
    parser.add_argument("--rates", default="500,2000")
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="niceness increment for the bench and its servers (negative, as root: less disturbed "
        "by other work on a shared machine; the report records it)",
    )
    args = parser.parse_args(argv)
    if args.nice:
        os.nice(args.nice)  # inherited by the emulator and gateway processes started below
    rates = [float(r) for r in args.rates.split(",")]
    duration, rounds = (3.0, 1) if args.quick else (10.0, 3)
    started = time.monotonic()
    results = measure(rates, duration, rounds)
    report = {
        "benchmark": "gateway overhead (proxy mode, zero-delay search emulator, /retrieve)",
        "command": "python -m benchmarks.gateway_bench --out FILE"
        + (" --quick" if args.quick else "")
        + (f" --nice {args.nice}" if args.nice else ""),
        "duration_s_per_run": duration,
        "rounds": rounds,
        "cpus": os.cpu_count(),
        "loadavg_1m_at_start": os.getloadavg()[0],
        "niceness": os.nice(0),
        "target_500rps": {"added_p50_ms": 1.0, "added_p99_ms": 5.0},
        "results": results,
        "seconds": round(time.monotonic() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(
        f"{'rate':>8} {'pct':>6} {'direct ms':>10} {'gateway ms':>11} {'added ms':>9} {'ratio':>6}"
    )
    for rate, r in results.items():
        for k in r["direct_ms"]:
            ratio = r["ratio_gateway_over_direct"][k]
            print(
                f"{rate:>8} {k:>6} {r['direct_ms'][k]:>10.3f} {r['gateway_ms'][k]:>11.3f} "
                f"{r['added_ms'][k]:>9.3f} {ratio if ratio is None else round(ratio, 2):>6}"
            )
    for rate, r in results.items():
        cpu = r["cpu_us_per_call"]
        print(
            f"{rate:>8} CPU per call: gateway {cpu['gateway']:.0f} us, emulator {cpu['emulator (baseline)']:.0f} us "
            f"(ratio {cpu['gateway'] / max(cpu['emulator (baseline)'], 1e-9):.2f})"
        )
    print(
        f"load average (1 min) at start: {report['loadavg_1m_at_start']:.1f} on {os.cpu_count()} CPUs"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
