"""Turn a `LoadResult` into figures: per-outcome HdrHistogram percentiles, rates, latency over time."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from hdrh.histogram import HdrHistogram

    from .loadgen import LoadResult

PERCENTILES: tuple[tuple[str, float], ...] = (
    ("p50", 50.0),
    ("p90", 90.0),
    ("p99", 99.0),
    ("p99.9", 99.9),
)


def histogram_figures(hist: HdrHistogram, mean_ms: float | None = None) -> dict[str, float]:
    """p50/p90/p99/p99.9/max/mean in ms from a histogram recorded in microseconds.

    `mean_ms` (the exact mean, when the raw values are at hand) spares the histogram's slow
    pure-Python mean."""
    if hist.get_total_count() == 0:
        return {name: math.nan for name, _ in PERCENTILES} | {"max": math.nan, "mean": math.nan}
    out = {name: hist.get_value_at_percentile(q) / 1000.0 for name, q in PERCENTILES}
    out["max"] = hist.get_max_value() / 1000.0
    out["mean"] = mean_ms if mean_ms is not None else hist.get_mean_value() / 1000.0
    return out


def _figures(result: LoadResult, outcome: str, corrected: bool) -> dict[str, float]:
    from .loadgen import make_histogram

    lat = result.latencies_ms(outcome, corrected)
    return histogram_figures(make_histogram(lat), float(lat.mean()) if len(lat) else None)


def differs(
    a: dict[str, float], b: dict[str, float], rel: float = 0.05, abs_ms: float = 1.0
) -> bool:
    """Whether corrected and uncorrected figures differ enough to be worth showing both."""
    for key in ("p50", "p99", "p99.9", "max"):
        x, y = a.get(key, math.nan), b.get(key, math.nan)
        if math.isnan(x) or math.isnan(y):
            continue
        if abs(x - y) > max(abs_ms, rel * max(abs(x), abs(y))):
            return True
    return False


def over_time(result: LoadResult, bins: int = 60) -> list[dict[str, float]]:
    """Corrected latency per time slice (by scheduled time): count, errors, p50, p99, max."""
    if result.n == 0:
        return []
    span = max(float(np.nanmax(result.scheduled)), 1e-9)
    width = 1.0 if span >= bins else max(span / bins, 0.1)  # 1 s slices for long runs
    lat = (result.done - result.scheduled) * 1000.0
    ok = result.outcomes == "ok"
    slice_of = np.floor(result.scheduled / width).astype(np.int64)
    out = []
    for k in range(int(slice_of.max()) + 1):
        sel = slice_of == k
        sel_ok = sel & ok & ~np.isnan(lat)
        vals = lat[sel_ok]
        out.append(
            {
                "t_s": round(k * width, 3),
                "count": int(np.count_nonzero(sel)),
                "errors": int(np.count_nonzero(sel & ~ok)),
                "p50_ms": float(np.percentile(vals, 50)) if len(vals) else math.nan,
                "p99_ms": float(np.percentile(vals, 99)) if len(vals) else math.nan,
                "max_ms": float(vals.max()) if len(vals) else math.nan,
            }
        )
    return out


def _lag_figures(lag: np.ndarray) -> dict[str, float]:
    return {
        "p50": float(np.percentile(lag, 50)) if len(lag) else math.nan,
        "p99": float(np.percentile(lag, 99)) if len(lag) else math.nan,
        "max": float(lag.max()) if len(lag) else math.nan,
    }


def _spec_dict(result: LoadResult) -> dict[str, Any]:
    spec = asdict(result.spec) if hasattr(result.spec, "__dataclass_fields__") else {}
    for key in ("body", "bodies", "progress", "start_at"):
        spec.pop(key, None)
    spec["headers"] = dict(spec.get("headers") or {})
    spec["capture_headers"] = list(spec.get("capture_headers") or ())
    return spec


def summarize(result: LoadResult) -> dict[str, Any]:
    """The JSON-ready report of one run (also what SLOs are checked against)."""
    outcomes = result.outcomes
    n = result.n
    names, counts = np.unique(outcomes.astype(str), return_counts=True) if n else ([], [])
    per_outcome: dict[str, Any] = {}
    for name, count in sorted(zip(names, counts, strict=True), key=lambda x: (x[0] != "ok", x[0])):
        corrected = _figures(result, name, corrected=True)
        entry: dict[str, Any] = {
            "count": int(count),
            "share": float(count) / n,
            "corrected_ms": corrected,
        }
        if name not in ("dropped", "unfinished"):
            uncorrected = _figures(result, name, corrected=False)
            entry["uncorrected_ms"] = uncorrected
            entry["differs"] = differs(corrected, uncorrected)
        per_outcome[str(name)] = entry
    status_values, status_counts = np.unique(result.status[result.status > 0], return_counts=True)
    not_ok = n - int(per_outcome.get("ok", {}).get("count", 0))
    timeouts = int(per_outcome.get("timeout", {}).get("count", 0))
    return {
        "spec": _spec_dict(result),
        "requests": n,
        "sent": int(np.count_nonzero(~np.isnan(result.sent))),
        "responses": int(np.count_nonzero(result.status > 0)),
        "duration_s": result.spec.duration_s,
        "wall_s": result.wall_s,
        "target_rate": result.target_rate,
        "achieved_rate": result.achieved_rate,
        "throughput": result.throughput,
        "error_rate": not_ok / n if n else 0.0,
        "timeout_rate": timeouts / n if n else 0.0,
        "status_counts": {
            str(int(s)): int(c) for s, c in zip(status_values, status_counts, strict=True)
        },
        "outcomes": per_outcome,
        "scheduling_error_ms": _lag_figures(result.scheduling_error_ms),
        "send_lag_ms": _lag_figures(result.send_lag_ms),
        "over_time": over_time(result),
        "connect_errors": result.connect_errors,
    }
