"""Fidelity bench: replay the search trace's latencies through the HTTP service, open loop.

`python -m benchmarks.emulators_bench --out FILE [--quick]` (run by `make bench`). The service runs as its own
uvicorn process with a trace-replay profile: the PolyTrace search_r1 latencies in a seeded random
order (so that any window of the run, not only whole passes over the trace, has the trace's
distribution), looping; the project's load generator (`stress`, imported by the
bench only: the emulator runtime does not depend on it; one load process per 1,000 rps, at most
two) sends `POST /retrieve` on a fixed schedule at 200, 1,000 and 2,000 requests/s for 30 s each,
with at most 10,000 requests in flight, capturing `X-Toolenv-Injected-Delay-Ms` and
`X-Toolenv-Timer-Error-Ms` per response. Latency is measured from each request's *planned* send
time (no coordinated omission); the generator wakes for each send from a timerfd and polls the last
0.1 ms (`precise_sends`), so that its own lateness (0.2-0.3 ms at the median with the loop's
millisecond timers) is not charged to the service.

Reported per rate, realized against target (the trace's own latency distribution, the baseline):
KS distance, realized/target ratio and relative error at p50/p90/p99/p99.9, timer error (realized
latency minus the delay the server scheduled, from `X-Toolenv-Injected-Delay-Ms`) at p50/p99 as
the client sees it (what is left after the service's pacing: the residual) and as the server
measured its own wake-up (`X-Toolenv-Timer-Error-Ms`, about minus `X-Toolenv-Pacing-Lead-Ms`, the
response path the service measured and wakes early by), and
dropped requests (errors, over the in-flight cap, or unanswered), and how the KS distance builds
up part by part (`ks_breakdown`: the replayed draws, + the server's wake-up, + the path from the
client's send to its receipt, + the generator's send lag), with the trace quantile of the gap. Timer error is also
given from the moment each request actually left the client, and the load side's own lag
(actual minus planned send time) is reported, to tell a slow service from a starved client.
A zero-delay run at 1,000 rps gives the HTTP floor. The first 2 s of each run are warm-up (connections opening) and are
left out of the statistics.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from stress import LoadSpec, run_load
from toolenv_core import headers
from toolenv_core.latency import Profile, save_profile
from toolenv_core.latency.specs import Constant, TraceReplay
from toolenv_core.plotting import pyplot
from toolenv_core.polytrace import tool_latencies

from .harness import (
    ServerProcess,
    polytrace_file,
    positive_float,
    report_path,
    toolenv_server,
)
from .ks_breakdown import BREAKDOWN_STEPS, ks_breakdown, quantile

DEFAULT_TRACE = "search_r1"
QUANTILES = (0.5, 0.9, 0.99, 0.999)
TARGETS_1000 = {"ks": 0.01, "quantile_rel_error": 0.02, "timer_error_p99_ms": 5.0, "dropped": 0}
WARMUP_S = 2.0
SEND_SPIN_S = 0.0001


def emulator(profile_path: Path, pacing: bool = True) -> ServerProcess:
    """`toolenv emulators serve --profile PATH` on a free port (started by `with`); without
    `pacing`, the handler wakes at the scheduled moment itself (no lead for the response path)."""
    return toolenv_server(
        "emulators", "serve", "--profile", str(profile_path), ready_timeout_s=90,
        env=None if pacing else {"TOOLENV_EMULATORS_MAX_PACING_LEAD_S": "0"},
    )  # fmt: skip


# ------------------------------------------------------------------ load side (stress)

INJECTED_HEADER = headers.INJECTED_DELAY
TIMER_HEADER = headers.TIMER_ERROR
LEAD_HEADER = headers.PACING_LEAD


def _header_s(values: list[str | None]) -> np.ndarray:
    """Captured header values in ms -> seconds (NaN where a response lacked the header)."""
    return np.array([float(v) / 1000 if v is not None else math.nan for v in values])


def _max_in_flight(dispatched: np.ndarray, done: np.ndarray) -> int:
    """Most requests outstanding at once (handed to the client and not yet ended)."""
    sel = np.isfinite(dispatched) & np.isfinite(done)
    times = np.concatenate([dispatched[sel], done[sel]])
    steps = np.concatenate([np.ones(int(sel.sum())), -np.ones(int(sel.sum()))])
    order = np.lexsort((steps, times))  # at equal times, ends before starts
    return int(np.cumsum(steps[order]).max()) if times.size else 0


def run_rate(url: str, rate: float, seconds: float, max_in_flight: int) -> dict[str, Any]:
    """Drive the service at `rate` for `seconds` (open loop, constant rate) from 1-2 load
    processes; per-request arrays, times in seconds from the run's start."""
    workers = max(1, min(2, math.ceil(rate / 1000)))
    result = run_load(
        LoadSpec(
            url=url + "/retrieve",
            bodies=[{"queries": [f"bench query {i}"]} for i in range(997)],
            arrival="constant",
            rate=rate,
            duration_s=seconds,
            max_requests=math.ceil(rate * seconds),
            max_in_flight=max_in_flight,
            timeout_s=30.0,
            capture_headers=[INJECTED_HEADER, TIMER_HEADER, LEAD_HEADER],
            workers=workers,
            # sends woken by a timerfd 0.1 ms early, then polled: the loop's millisecond timers
            # would send 0.2-0.3 ms late at the median, an error of the generator itself that
            # latency counted from the planned send time would charge to the service
            precise_sends=True,
            spin_s=SEND_SPIN_S,
            # connections for the expected concurrency, opened before the clock starts
            preconnect=min(max_in_flight // workers, int(rate / workers * 0.6) + 16),
        )
    )
    outcomes = result.outcomes
    not_ok = outcomes[outcomes != "ok"]
    kinds, counts = np.unique(not_ok.astype(str), return_counts=True)
    return {
        "planned": result.scheduled,
        "sent": result.sent,
        "done": result.done,
        "ok": (outcomes == "ok") & (result.status == 200),
        "injected": _header_s(result.captured_values(INJECTED_HEADER)),
        "server_err": _header_s(result.captured_values(TIMER_HEADER)),
        "lead": _header_s(result.captured_values(LEAD_HEADER)),
        "over_cap": int(np.count_nonzero(outcomes == "dropped")),
        "max_in_flight": _max_in_flight(result.dispatched, result.done),
        "processes": workers,
        "not_ok": {str(k): int(c) for k, c in zip(kinds, counts, strict=True)},
        "error_samples": list(result.connect_errors)[:5],
    }


# ------------------------------------------------------------------ statistics


def summarize(raw: dict, target: np.ndarray, rate: float, seconds: float) -> dict[str, Any]:

    ok = raw["ok"]
    keep = raw["planned"] >= WARMUP_S
    sel = ok & keep
    realized = raw["done"][sel] - raw["planned"][sel]
    scheduled = raw["injected"][sel]
    timer = realized - scheduled
    # The same from the moment the request left the client (without the load side's own lag).
    timer_from_send = raw["done"][sel] - raw["sent"][sel] - scheduled
    send_lag = raw["sent"][sel] - raw["planned"][sel]
    server_timer = raw["server_err"][sel]
    lead = raw["lead"][sel]
    dropped = int((~ok).sum())
    sent_at = raw["sent"][np.isfinite(raw["sent"])]
    span = float(sent_at.max() - sent_at.min()) if sent_at.size > 1 else math.nan
    window = raw["done"][ok & keep] if (ok & keep).any() else np.array([])
    out: dict[str, Any] = {
        "target_rps": rate,
        "seconds": seconds,
        "sent": int(raw["ok"].size - raw["over_cap"]),
        "completed_ok": int(ok.sum()),
        # Requests that actually left the client per second (open loop: should equal the target).
        "achieved_rps": round((sent_at.size - 1) / span, 1) if span and span > 0 else None,
        # Answers per second over the measured window (falls behind when the service saturates).
        "answered_rps": round(window.size / (window.max() - window.min()), 1)
        if window.size > 1
        else None,
        "dropped": dropped,
        "dropped_over_in_flight_cap": int(raw["over_cap"]),
        "errors": int((~ok).sum() - raw["over_cap"]),
        "not_ok_by_outcome": raw["not_ok"],
        "max_in_flight": int(raw["max_in_flight"]),
        "load_processes": int(raw["processes"]),
        "measured": int(sel.sum()),
        "error_samples": raw["error_samples"],
    }
    if realized.size:
        out["ks_realized_vs_target"] = float(stats.ks_2samp(realized, target).statistic)
        out["ks_scheduled_vs_target"] = float(stats.ks_2samp(scheduled, target).statistic)
        out["ks_realized_vs_scheduled"] = float(stats.ks_2samp(realized, scheduled).statistic)
        out["ks_breakdown"] = ks_breakdown(
            scheduled, server_timer, timer_from_send, realized, target
        )
        out["error_parts_ms"] = {
            part: {"p50": quantile(v, 0.5) * 1000, "mean": float(np.mean(v)) * 1000}
            for part, v in (
                ("a_server_wake", server_timer),
                ("b_path_from_send", timer_from_send - server_timer),
                ("c_send_lag", send_lag),
            )
        }
        out["quantiles"] = {
            f"p{p * 100:g}": {
                "target_s": quantile(target, p),
                "realized_s": quantile(realized, p),
                "ratio": quantile(realized, p) / quantile(target, p),
                "rel_error": quantile(realized, p) / quantile(target, p) - 1,
            }
            for p in QUANTILES
        }
        # Against the delays actually scheduled in this run (a short run replays only part of the
        # shuffled trace, whose own quantiles differ from the whole trace's by a few percent).
        out["quantile_ratio_realized_vs_scheduled"] = {
            f"p{p * 100:g}": quantile(realized, p) / quantile(scheduled, p) for p in QUANTILES
        }
        out["timer_error_ms"] = {
            "client_p50": quantile(timer, 0.5) * 1000,
            "client_p99": quantile(timer, 0.99) * 1000,
            "client_p99.9": quantile(timer, 0.999) * 1000,
            "from_send_p50": quantile(timer_from_send, 0.5) * 1000,
            "from_send_p99": quantile(timer_from_send, 0.99) * 1000,
            "load_side_send_lag_p50": quantile(send_lag, 0.5) * 1000,
            "load_side_send_lag_p99": quantile(send_lag, 0.99) * 1000,
            "server_p50": quantile(server_timer, 0.5) * 1000,
            "server_p99": quantile(server_timer, 0.99) * 1000,
            "server_p99.9": quantile(server_timer, 0.999) * 1000,
            # how early the service woke on purpose (its measured response path; timing.Pacer)
            "server_lead_p50": quantile(lead, 0.5) * 1000,
            "server_lead_p99": quantile(lead, 0.99) * 1000,
        }
    return out


def verdict(s: dict[str, Any]) -> dict[str, bool]:
    if "quantiles" not in s:
        return {"ran": False}
    return {
        "ks<=0.01": s["ks_realized_vs_target"] <= TARGETS_1000["ks"],
        "quantiles_within_2%": all(
            abs(v["rel_error"]) <= TARGETS_1000["quantile_rel_error"]
            for v in s["quantiles"].values()
        ),
        "timer_error_p99<=5ms": s["timer_error_ms"]["client_p99"]
        <= TARGETS_1000["timer_error_p99_ms"],
        "nothing_dropped": s["dropped"] == 0,
    }


def plot(results: list[dict], target: np.ndarray, raws: list[dict], out: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    t = np.sort(target)
    ax.plot(t, np.arange(1, t.size + 1) / t.size, color="black", lw=2, label="trace (target)")
    for s, raw in zip(results, raws, strict=True):
        sel = raw["ok"] & (raw["planned"] >= WARMUP_S)
        r = np.sort(raw["done"][sel] - raw["planned"][sel])
        if r.size:
            ax.plot(
                r,
                np.arange(1, r.size + 1) / r.size,
                lw=1,
                label=f"realized at {s['target_rps']:g} rps (KS {s['ks_realized_vs_target']:.4f})",
            )
    ax.set_xscale("log")
    ax.set_xlabel("search latency (s)")
    ax.set_ylabel("P(latency <= x)")
    ax.set_title("search emulator: realized vs recorded latency (open loop)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def _ab_figures(s: dict[str, Any]) -> dict[str, float]:
    te = s.get("timer_error_ms", {})
    return {
        "ks": s.get("ks_realized_vs_target", math.nan),
        # timing alone: against the delays this run scheduled (a part of the shuffled trace)
        "ks_vs_scheduled": s.get("ks_realized_vs_scheduled", math.nan),
        "p50_rel_error": s.get("quantiles", {}).get("p50", {}).get("rel_error", math.nan),
        "p99_rel_error": s.get("quantiles", {}).get("p99", {}).get("rel_error", math.nan),
        "client_timer_p50_ms": te.get("client_p50", math.nan),
        "client_timer_p99_ms": te.get("client_p99", math.nan),
        "from_send_p50_ms": te.get("from_send_p50", math.nan),
        "server_wake_p50_ms": te.get("server_p50", math.nan),
        "lead_p50_ms": te.get("server_lead_p50", math.nan),
        "dropped": s["dropped"],
    }


def pacing_ab(
    replay: Path, target: np.ndarray, seconds: float, args: argparse.Namespace
) -> dict[str, Any]:
    """Pairs of runs at 1,000 rps, pacing off then on: the same-run baseline for pacing."""
    rounds: list[dict[str, Any]] = []
    for i in range(args.pacing_ab):
        pair: dict[str, Any] = {"load_average": os.getloadavg()[0]}
        for mode in ("off", "on"):
            with emulator(replay, pacing=mode == "on") as service:
                raw = run_rate(service.url, 1000, seconds + WARMUP_S, args.max_in_flight)
            pair[mode] = _ab_figures(summarize(raw, target, 1000, seconds))
        rounds.append(pair)
        print(
            f"pacing A/B round {i + 1}: KS off {pair['off']['ks']:.4f} on {pair['on']['ks']:.4f};"
            f" client timer p50 off {pair['off']['client_timer_p50_ms']:.2f} ms"
            f" on {pair['on']['client_timer_p50_ms']:.2f} ms (lead"
            f" {pair['on']['lead_p50_ms']:.3f} ms)",
            flush=True,
        )
    medians = {
        mode: {key: float(np.median([r[mode][key] for r in rounds])) for key in rounds[0][mode]}
        for mode in ("off", "on")
    }
    return {"rounds": rounds, "median": medians}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=report_path,
        default=Path("bench-results/benchmarks.emulators_bench.json"),
        help="JSON report path (a PNG is written beside it)",
    )
    parser.add_argument("--quick", action="store_true", help="5 s per rate instead of 30 s")
    parser.add_argument(
        "--trace",
        type=Path,
        help="PolyTrace search trace, file or dir (default: search_r1, from the trace cache "
        "`toolenv traces fetch search_r1` fills, or $TOOLENV_POLYTRACE_DIR)",
    )
    parser.add_argument("--rates", type=positive_float, nargs="*", default=[200, 1000, 2000])
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--max-in-flight", type=int, default=10_000)
    parser.add_argument(
        "--pacing-ab",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="also run ROUNDS pairs at 1,000 rps, pacing off then on (a fresh service each), "
        "so that the machine's load hits both alike",
    )
    args = parser.parse_args(argv)
    seconds = args.seconds or (5.0 if args.quick else 30.0)
    try:
        args.trace = polytrace_file(args.trace, DEFAULT_TRACE)
        target = tool_latencies([args.trace], "search")
    except ValueError as exc:  # not found, unreadable, or no search call in it
        parser.error(str(exc))
    report: dict[str, Any] = {
        "bench": "emulators.fidelity",
        "command": "python -m benchmarks.emulators_bench --out FILE"
        + (" --quick" if args.quick else ""),
        "trace": str(args.trace),
        "trace_calls": int(target.size),
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "targets_at_1000_rps": TARGETS_1000,
        "warmup_excluded_s": WARMUP_S,
        "rates": [],
    }
    raws = []
    with tempfile.TemporaryDirectory() as tmp:
        shuffled = np.random.default_rng(2509).permutation(target)
        replay = save_profile(
            Profile(
                tool="search",
                model=TraceReplay(values_s=[float(v) for v in shuffled]),
                source=f"PolyTrace {args.trace.name} (bench)",
            ),
            Path(tmp) / "replay.json",
        )
        zero = save_profile(
            Profile(tool="search", model=Constant(value_s=0.0), source="bench baseline"),
            Path(tmp) / "zero.json",
        )
        # Baseline: the HTTP floor of this machine at 1,000 rps with no injected delay.
        with emulator(zero) as service:
            base = run_rate(service.url, 1000, min(seconds, 5.0) + WARMUP_S, args.max_in_flight)
        sel = base["ok"] & (base["planned"] >= WARMUP_S)
        floor = base["done"][sel] - base["planned"][sel]
        report["baseline_zero_delay_1000rps_ms"] = {
            "p50": quantile(floor, 0.5) * 1000,
            "p99": quantile(floor, 0.99) * 1000,
            "dropped": int((~base["ok"]).sum()),
        }
        print(
            f"baseline (zero delay, 1000 rps): p50 {report['baseline_zero_delay_1000rps_ms']['p50']:.2f} ms, p99 {report['baseline_zero_delay_1000rps_ms']['p99']:.2f} ms",
            flush=True,
        )
        for rate in args.rates:
            # a fresh service per rate: the replay starts at the trace's first call
            with emulator(replay) as service:
                raw = run_rate(service.url, rate, seconds + WARMUP_S, args.max_in_flight)
            s = summarize(raw, target, rate, seconds)
            s["meets_1000rps_targets"] = verdict(s)
            report["rates"].append(s)
            raws.append(raw)
            q = s.get("quantiles", {})
            te = s.get("timer_error_ms", {})
            print(
                f"{rate:>6g} rps: achieved {s['achieved_rps']} rps, KS {s.get('ks_realized_vs_target', float('nan')):.4f}, "
                + ", ".join(f"{k} x{v['ratio']:.3f}" for k, v in q.items())
                + f", timer error p50 {te.get('client_p50', float('nan')):.2f} ms p99 {te.get('client_p99', float('nan')):.2f} ms"
                + f" (server wake p99 {te.get('server_p99', float('nan')):.2f} ms, pacing lead p50"
                + f" {te.get('server_lead_p50', float('nan')):.3f} ms), dropped {s['dropped']}",
                flush=True,
            )
            if "ks_breakdown" in s:
                parts = s["ks_breakdown"]
                print(
                    "         KS by part: "
                    + ", ".join(f"{k} {parts[k]['ks']:.4f}" for k in BREAKDOWN_STEPS)
                    + f"; the gap at the trace's p{100 * parts[BREAKDOWN_STEPS[-1]]['at_target_quantile']:.1f}",
                    flush=True,
                )
        if args.pacing_ab:
            report["pacing_ab"] = pacing_ab(replay, target, seconds, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = args.out.with_suffix(".png")
    plot(report["rates"], target, raws, png)
    report["plot"] = str(png)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"report: {args.out}, plot: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
