"""How far realized latencies are from a target distribution (KS distance, its sign and where),
and how that distance builds up part by part: what `emulators_bench` reports at each rate."""

from __future__ import annotations

import math

import numpy as np

# the cumulative parts of `ks_breakdown`, in order (the last is the realized latency)
BREAKDOWN_STEPS = (
    "d_scheduled",
    "a_plus_server_wake",
    "b_plus_path_from_send",
    "c_plus_send_lag_realized",
)


def quantile(values: np.ndarray, p: float) -> float:
    return float(np.quantile(values, p)) if values.size else math.nan


def ks_gap(sample: np.ndarray, target: np.ndarray) -> dict[str, float]:
    """KS distance of `sample` to `target`, its sign (+: the sample's CDF above, i.e. too fast),
    and where it is: the target's quantile and value at the largest gap."""
    a, t = np.sort(sample), np.sort(target)
    grid = np.concatenate([a, t])
    gap = np.searchsorted(a, grid, "right") / a.size - np.searchsorted(t, grid, "right") / t.size
    i = int(np.argmax(np.abs(gap)))
    return {
        "ks": float(abs(gap[i])),
        "signed": float(gap[i]),
        "at_target_quantile": float(np.searchsorted(t, grid[i], "right") / t.size),
        "at_s": float(grid[i]),
    }


def ks_breakdown(
    scheduled: np.ndarray,
    server_wake: np.ndarray,
    from_send: np.ndarray,
    realized: np.ndarray,
    target: np.ndarray,
) -> dict[str, dict[str, float]]:
    """How the KS distance builds up, one part of the error at a time (cumulative).

    (d) the delays the service scheduled: which trace values this window replayed (the floor no
    timer can beat); (a) + the server's wake-up error (`X-Toolenv-Timer-Error-Ms`, the pacing lead
    included); (b) + the rest from the client's send to its receipt (kernel both ways, the
    server's loop before it parses the request, building and writing the reply, the client's
    parse); (c) + the load generator's send lag behind its plan = the realized latency."""
    return {
        "d_scheduled": ks_gap(scheduled, target),
        "a_plus_server_wake": ks_gap(scheduled + server_wake, target),
        "b_plus_path_from_send": ks_gap(scheduled + from_send, target),
        "c_plus_send_lag_realized": ks_gap(realized, target),
        "b_alone": ks_gap(scheduled + from_send - server_wake, target),
        "c_alone": ks_gap(realized - from_send, target),  # scheduled + send lag
    }
