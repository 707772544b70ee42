"""Figures from latency arrays: HdrHistogram percentiles, latency over time, lateness.

Pure functions of numpy arrays (milliseconds or seconds from a run's start), so that
`result.LoadResult` composes its summary from them and nothing here depends on a result type.
"""

from __future__ import annotations

import math

import numpy as np
from hdrh.histogram import HdrHistogram

# HdrHistogram range: 1 us .. 1 h, 3 significant digits (0.1% resolution).
HIST_LOWEST_US = 1
HIST_HIGHEST_US = 3_600_000_000
HIST_DIGITS = 3
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


def make_histogram(latencies_ms: np.ndarray) -> HdrHistogram:
    hist = HdrHistogram(HIST_LOWEST_US, HIST_HIGHEST_US, HIST_DIGITS)
    if len(latencies_ms):
        us = np.clip(np.rint(latencies_ms * 1000.0), HIST_LOWEST_US, HIST_HIGHEST_US).astype(
            np.int64
        )
        # fold each value onto the lowest value of its histogram bucket first (values in one
        # bucket are indistinguishable at 3 digits), so that few record_value calls remain
        shift = np.maximum(0, np.floor(np.log2(us)).astype(np.int64) - 10)
        us = (us >> shift) << shift
        values, counts = np.unique(us, return_counts=True)
        for v, c in zip(values.tolist(), counts.tolist(), strict=True):
            hist.record_value(v, c)
    return hist


def latency_figures(latencies_ms: np.ndarray) -> dict[str, float]:
    """`histogram_figures` of raw latencies (with their exact mean)."""
    hist = make_histogram(latencies_ms)
    return histogram_figures(hist, float(latencies_ms.mean()) if len(latencies_ms) else None)


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


def over_time(
    scheduled: np.ndarray, done: np.ndarray, ok: np.ndarray, bins: int = 60
) -> list[dict[str, float]]:
    """Corrected latency per time slice (by scheduled time, s): count, errors, p50, p99, max."""
    if len(scheduled) == 0:
        return []
    span = max(float(np.nanmax(scheduled)), 1e-9)
    width = 1.0 if span >= bins else max(span / bins, 0.1)  # 1 s slices for long runs
    lat = (done - scheduled) * 1000.0
    slice_of = np.floor(scheduled / width).astype(np.int64)
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


def lag_figures(lag: np.ndarray) -> dict[str, float]:
    return {
        "p50": float(np.percentile(lag, 50)) if len(lag) else math.nan,
        "p99": float(np.percentile(lag, 99)) if len(lag) else math.nan,
        "max": float(lag.max()) if len(lag) else math.nan,
    }
