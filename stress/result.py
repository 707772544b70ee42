"""What one run measured: `LoadResult` (per-request arrays, times relative to the start),
its per-request view and its JSON-ready summary."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from hdrh.histogram import HdrHistogram

from toolenv_core.http1 import ERROR_KINDS

from .spec import LoadSpec
from .stats import differs, lag_figures, latency_figures, make_histogram, over_time

# Request headers whose values are credentials: the report names them, never shows their
# values (a gateway's `Authorization: Bearer <key>` was written into every --out file).
SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie", "x-api-key"})


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request. Times are seconds from the run's start; NaN when it never happened."""

    index: int
    scheduled_s: float
    sent_s: float
    done_s: float
    status: int  # HTTP status, 0 when no response
    error: str  # "" or one of toolenv_core.http1.ERROR_KINDS
    headers: Mapping[str, str]  # captured response headers

    @property
    def latency_ms(self) -> float:
        """From the scheduled send time (coordinated-omission free)."""
        return (self.done_s - self.scheduled_s) * 1000.0

    @property
    def service_ms(self) -> float:
        """From the actual send time (what a naive client reports)."""
        return (self.done_s - self.sent_s) * 1000.0

    @property
    def outcome(self) -> str:
        return outcome_name(self.status, self.error)


def outcome_name(status: int, error: str) -> str:
    if error:
        return error
    return "ok" if 200 <= status < 400 else f"http_{status}"


@dataclass
class LoadResult:
    """Everything one run measured. Arrays are indexed by request, times relative to start."""

    spec: LoadSpec
    start: float  # time.monotonic() of scheduled time 0
    scheduled: np.ndarray
    sent: np.ndarray
    done: np.ndarray
    status: np.ndarray
    error: np.ndarray
    captured: dict[int, dict[str, str]]
    wall_s: float
    connect_errors: list[str] = field(default_factory=list)  # the first 5 distinct, each once
    dispatched: np.ndarray | None = None  # when the scheduler handed each request over
    interrupted: bool = False  # Ctrl-C ended it: the requests sent before it (`interrupt`)
    _summary: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    # ---- per request
    @cached_property
    def records(self) -> list[RequestRecord]:
        empty: dict[str, str] = {}
        captured = self.captured
        columns = zip(
            self.scheduled.tolist(),
            self.sent.tolist(),
            self.done.tolist(),
            self.status.tolist(),
            self.error.tolist(),
            strict=True,
        )
        return [
            RequestRecord(i, sc, se, do, st, ERROR_KINDS[er], captured.get(i, empty))
            for i, (sc, se, do, st, er) in enumerate(columns)
        ]

    @cached_property
    def outcomes(self) -> np.ndarray:
        """Outcome name per request ("ok", "http_503", "timeout", ...)."""
        # one name per distinct (status, error) pair, not per request: fast for millions
        keys = self.status.astype(np.int64) * 256 + self.error.astype(np.int64)
        uniq, inverse = np.unique(keys, return_inverse=True)
        table = np.array(
            [outcome_name(int(k) // 256, ERROR_KINDS[int(k) % 256]) for k in uniq.tolist()],
            dtype=object,
        )
        return table[inverse.reshape(-1)] if len(keys) else np.empty(0, dtype=object)

    def captured_values(self, header: str) -> list[str | None]:
        """One captured header's value per request (None where the response lacked it)."""
        return [self.captured.get(i, {}).get(header) for i in range(len(self.scheduled))]

    # ---- latency
    def latencies_ms(self, outcome: str | None = "ok", corrected: bool = True) -> np.ndarray:
        """Latencies in ms of requests with `outcome` (None: every request that got an end)."""
        origin = self.scheduled if corrected else self.sent
        lat = (self.done - origin) * 1000.0
        mask = ~np.isnan(lat)
        if outcome is not None:
            mask &= self.outcomes == outcome
        return lat[mask]

    def histogram(self, outcome: str | None = "ok", corrected: bool = True) -> HdrHistogram:
        """An HdrHistogram of latencies in microseconds (1 us .. 1 h, 3 significant digits)."""
        return make_histogram(self.latencies_ms(outcome, corrected))

    @property
    def scheduling_error_ms(self) -> np.ndarray:
        """The generator's own lateness: scheduler hand-over time minus scheduled time."""
        if self.dispatched is None:
            return self.send_lag_ms
        lag = (self.dispatched - self.scheduled) * 1000.0
        return lag[~np.isnan(lag)]

    @property
    def send_lag_ms(self) -> np.ndarray:
        """Actual send time minus scheduled time: the generator's lateness plus any wait for a
        free or newly opened connection."""
        lag = (self.sent - self.scheduled) * 1000.0
        return lag[~np.isnan(lag)]

    # ---- rates
    @property
    def n(self) -> int:
        return len(self.scheduled)

    @property
    def target_rate(self) -> float | None:
        return None if self.spec.arrival == "closed" else self.spec.rate

    @property
    def achieved_rate(self) -> float:
        """Requests actually sent per second over the schedule (compare with the target: below
        it, the generator or its connections could not keep up, or requests were dropped)."""
        sent = self.sent[~np.isnan(self.sent)]
        if self.target_rate and len(sent):
            # n sends at the target rate span n / rate: the last one is due one period before
            # that (one request was 0.2 rps under --max-requests 1, 1000 rps at --duration 1ms).
            # Over the whole schedule: requests never sent (dropped) at its end do not make it
            # shorter (40 sent of 100 due read 200 rps, the target, and met `--slo rate=95%`).
            last = max(float(sent.max()), float(self.scheduled.max()))
            return len(sent) / (last + 1.0 / self.target_rate)
        # A closed loop's callers send back to back for as long as the run lasts: over that (a
        # last send's time left out the last round: 16 callers sending once read 8,911 rps, and
        # one request was 0.1 rps over --duration 10s in a run of 0.1 s).
        return len(sent) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def send_rate(self) -> float:
        return self.achieved_rate

    @property
    def throughput(self) -> float:
        """Successful responses per second, until the last response arrived (as vegeta counts).

        Lower than the sent rate when requests fail, or when a slow tail outlives the run."""
        ok = int(np.count_nonzero((self.status >= 200) & (self.status < 400) & (self.error == 0)))
        return ok / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """The JSON-ready figures (see `summarize`); computed once."""
        if self._summary is None:
            self._summary = summarize(self)
        return self._summary


def _spec_dict(result: LoadResult) -> dict[str, Any]:
    spec = asdict(result.spec)
    for key in ("body", "bodies", "progress", "start_at", "interruptible"):
        spec.pop(key, None)
    spec["headers"] = {
        name: "***" if name.lower() in SECRET_HEADERS else value
        for name, value in (spec.get("headers") or {}).items()
    }
    spec["capture_headers"] = list(spec.get("capture_headers") or ())
    return spec


def summarize(result: LoadResult) -> dict[str, Any]:
    """The JSON-ready report of one run (also what SLOs are checked against)."""
    outcomes = result.outcomes
    n = result.n
    names, counts = np.unique(outcomes.astype(str), return_counts=True) if n else ([], [])
    per_outcome: dict[str, Any] = {}
    for name, count in sorted(zip(names, counts, strict=True), key=lambda x: (x[0] != "ok", x[0])):
        # a dropped request was never sent: the time until it was dropped (the generator's own
        # lag) read as its latency in the table ("dropped ... p50 0.30 ms")
        never_sent = name == "dropped"
        corrected = latency_figures(np.empty(0) if never_sent else result.latencies_ms(name))
        entry: dict[str, Any] = {
            "count": int(count),
            "share": float(count) / n,
            "corrected_ms": corrected,
        }
        if name not in ("dropped", "unfinished"):
            uncorrected = latency_figures(result.latencies_ms(name, corrected=False))
            entry["uncorrected_ms"] = uncorrected
            entry["differs"] = differs(corrected, uncorrected)
        per_outcome[str(name)] = entry
    status_values, status_counts = np.unique(result.status[result.status > 0], return_counts=True)
    not_ok = n - int(per_outcome.get("ok", {}).get("count", 0))
    timeouts = int(per_outcome.get("timeout", {}).get("count", 0))
    cap = result.spec.request_cap()
    return {
        "spec": _spec_dict(result),
        "requests": n,
        "sent": int(np.count_nonzero(~np.isnan(result.sent))),
        "responses": int(np.count_nonzero(result.status > 0)),
        "duration_s": result.spec.duration_s,
        "request_cap": cap,
        # what ended the sending: Ctrl-C, the cap (reached), else the duration
        "stopped_by": (
            "interrupted"
            if result.interrupted
            else "max_requests"
            if cap is not None and n >= cap
            else "duration"
        ),
        "sending_s": float(result.scheduled.max()) if n else 0.0,  # the last send's schedule
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
        "scheduling_error_ms": lag_figures(result.scheduling_error_ms),
        "send_lag_ms": lag_figures(result.send_lag_ms),
        "over_time": over_time(result.scheduled, result.done, result.outcomes == "ok"),
        "connect_errors": result.connect_errors,
    }
