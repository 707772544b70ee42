"""The fidelity bench's arithmetic, on records whose answers are known."""

from __future__ import annotations

import numpy as np

from benchmarks.emulators_bench import WARMUP_S, summarize, verdict


def _raw(target: np.ndarray, lateness_s: float, rate: float = 1000.0) -> dict:
    """What `run_rate` returns: per-request arrays, times in s from the run's start."""
    n = target.size
    planned = np.arange(n) / rate
    sent = planned + 0.0002
    done = sent + target + lateness_s
    return {
        "planned": planned,
        "sent": sent,
        "done": done,
        "injected": target.copy(),
        "server_err": np.full(n, lateness_s / 2),
        "lead": np.full(n, 0.0003),
        "ok": np.full(n, True),
        "max_in_flight": 7,
        "over_cap": 0,
        "processes": 1,
        "not_ok": {},
        "error_samples": [],
    }


def test_a_faithful_run_meets_the_targets_and_a_late_one_does_not() -> None:
    rng = np.random.default_rng(0)
    target = rng.lognormal(np.log(0.17), 1.0, 20_000)
    good = summarize(_raw(target, 0.0005), target, 1000, 20)
    assert good["measured"] == 20_000 - int(WARMUP_S * 1000)
    assert good["ks_realized_vs_target"] < 0.01 and good["ks_scheduled_vs_target"] < 0.01
    assert abs(good["timer_error_ms"]["client_p50"] - 0.7) < 0.01  # 0.2 ms send lag + 0.5 ms late
    assert abs(good["timer_error_ms"]["from_send_p50"] - 0.5) < 0.01
    assert abs(good["timer_error_ms"]["server_p99"] - 0.25) < 1e-6
    assert abs(good["timer_error_ms"]["server_lead_p50"] - 0.3) < 1e-6
    assert all(verdict(good).values()) and good["dropped"] == 0
    assert abs(good["achieved_rps"] - 1000) < 1

    late = summarize(_raw(target, 0.05), target, 1000, 20)
    checks = verdict(late)
    assert not checks["ks<=0.01"] and not checks["timer_error_p99<=5ms"]
    assert late["quantiles"]["p50"]["ratio"] > 1.2


def test_drops_and_errors_are_counted() -> None:
    target = np.full(5000, 0.1)
    raw = _raw(target, 0.001)
    raw["ok"][3000:3015] = False
    raw["sent"][3010:3015] = np.nan  # over the in-flight cap: never sent
    raw["over_cap"] = 5
    raw["not_ok"] = {"connection_closed": 10, "dropped": 5}
    s = summarize(raw, target, 1000, 5)
    assert s["dropped"] == 15 and s["errors"] == 10 and s["dropped_over_in_flight_cap"] == 5
    assert s["sent"] == 4995 and s["measured"] == 5000 - int(WARMUP_S * 1000) - 15
    assert not verdict(s)["nothing_dropped"]


def test_in_flight_peak_and_header_values_from_the_load_records() -> None:
    from benchmarks.emulators_bench import _header_s, _max_in_flight

    dispatched = np.array([0.0, 1.0, 2.0, 2.4, np.nan])  # the last one was never sent
    done = np.array([1.5, 2.5, 3.0, 2.6, 0.1])
    assert _max_in_flight(dispatched, done) == 3  # requests 1, 2 and 3 from 2.4 to 2.5
    assert _max_in_flight(np.array([0.0, 1.0]), np.array([1.0, 2.0])) == 1  # end, then start
    assert _max_in_flight(np.array([]), np.array([])) == 0
    got = _header_s(["12.5", None, "0.000"])
    assert got[0] == 0.0125 and np.isnan(got[1]) and got[2] == 0.0


def test_the_ks_breakdown_puts_each_error_where_it_arose() -> None:
    """A run whose only error is the load generator's 10 ms send lag, then one whose only error
    is a 10 ms late server wake-up: each shows up in its own step of the breakdown, at the
    target's densest region."""
    rng = np.random.default_rng(1)
    target = rng.lognormal(np.log(0.17), 1.0, 20_000)
    lagging = _raw(target, 0.0)
    lagging["sent"] = lagging["planned"] + 0.01
    lagging["done"] = lagging["sent"] + target
    lagging["server_err"] = np.zeros(target.size)
    parts = summarize(lagging, target, 1000, 20)["ks_breakdown"]
    assert parts["d_scheduled"]["ks"] < 0.01 and parts["b_plus_path_from_send"]["ks"] < 0.01
    assert parts["c_plus_send_lag_realized"]["ks"] > 0.02 and parts["c_alone"]["ks"] > 0.02
    assert parts["c_plus_send_lag_realized"]["signed"] < 0  # realized CDF below: too slow
    late = _raw(target, 0.01)
    late["sent"] = late["planned"].copy()
    late["server_err"] = np.full(target.size, 0.01)
    parts = summarize(late, target, 1000, 20)["ks_breakdown"]
    assert parts["a_plus_server_wake"]["ks"] > 0.02 and parts["b_alone"]["ks"] < 0.01
    assert parts["c_alone"]["ks"] < 0.01
    assert 0.05 < parts["a_plus_server_wake"]["at_target_quantile"] < 0.95
