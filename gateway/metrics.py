"""Prometheus metrics of one gateway app, in the app's own registry (no global state).

The per-call counts are plain numbers kept by the event loop (`LeanHistogram`, `LeanCounter`) and
turned into Prometheus families at scrape time by a prometheus-client `Collector`: a call records
four latencies and an outcome, and prometheus-client's own `observe` takes a lock and walks its
buckets in Python for each (about 1.5 us apiece, a fair part of a call's budget). Everything runs
on the one event-loop thread, scrapes included, so no lock is needed.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

# From 0.5 ms (the gateway's own overhead) to 5 minutes (a long sandbox run).
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip

OUTCOMES = (
    "ok", "error", "timeout", "rejected", "unavailable", "upstream_failed", "caller_gone",
    "cut_by_shutdown",
)  # fmt: skip

# Requests the gateway refused before any tool saw them, by reason (counted where each is refused:
# `guard.Door`, the lane, the hot routes): not calls of a tool, so not in calls_total, yet a caller
# got its 4xx (a refused request was seen nowhere in /metrics, nor in the logs)
REFUSALS = (
    "unauthorized", "rate_limited", "invalid_request", "unknown_tool", "too_large", "body_timeout",
)  # fmt: skip
REFUSED_HELP = (
    "Requests refused before reaching a tool: unauthorized (401, a missing or wrong API key), "
    "rate_limited (429, rate_limit_per_s), invalid_request (400 or 422: malformed JSON, a bad "
    "header or Content-Length, a generic call's body that is not an object of arguments), "
    "unknown_tool (404: no such tool on a tool route), too_large (413, max_body_bytes), "
    "body_timeout (408, the body not whole within body_timeout_s)."
)

# (name, help) of each per-tool histogram, in `ToolMetrics.histograms()` order
HISTOGRAMS = (
    ("toolenv_gateway_queue_wait_seconds", "Time a call waited for a concurrency slot (a call whose deadline ran out, or whose caller hung up, while waiting included)."),
    ("toolenv_gateway_upstream_seconds", "Time from sending to an upstream to its answer, per attempt that answered (a hedge's or a retry's own; an attempt that failed or was cancelled is not counted)."),
    ("toolenv_gateway_injected_delay_seconds", "Delay the emulators report injecting (X-Toolenv-Injected-Delay-Ms)."),
    ("toolenv_gateway_call_seconds", "Whole call as the caller sees it (queue + upstream + gateway)."),
)  # fmt: skip
CALLS_HELP = (
    "Calls by outcome: ok, error (upstream answered an error), timeout, rejected (429), "
    "unavailable (503), upstream_failed (502), caller_gone (the caller hung up first), "
    "cut_by_shutdown (still running when the shutdown grace ran out: 503)."
)


class LeanHistogram:
    """Counts per bucket (`LATENCY_BUCKETS`, then +Inf) and the sum."""

    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(LATENCY_BUCKETS, value)] += 1  # le: value <= bound
        self.sum += value


class LeanCounter:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def inc(self) -> None:
        self.value += 1


@dataclass(slots=True)
class ToolMetrics:
    """Every metric of one tool."""

    queue_wait: LeanHistogram
    upstream: LeanHistogram
    injected_delay: LeanHistogram
    total: LeanHistogram
    outcomes: dict[str, LeanCounter]
    hedged: LeanCounter
    retried: LeanCounter

    def histograms(self) -> tuple[LeanHistogram, ...]:
        """In `HISTOGRAMS` order."""
        return (self.queue_wait, self.upstream, self.injected_delay, self.total)

    @classmethod
    def new(cls) -> ToolMetrics:
        return cls(
            LeanHistogram(), LeanHistogram(), LeanHistogram(), LeanHistogram(),
            {o: LeanCounter() for o in OUTCOMES}, LeanCounter(), LeanCounter(),
        )  # fmt: skip


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.tools: dict[str, ToolMetrics] = {}
        self.registry.register(_CallsCollector(self.tools))

    def track_admission(self, snapshot: Callable[[], Iterable[tuple[str, int, int]]]) -> None:
        """In-flight and queued gauges, read from the admission state at scrape time.

        (Cheaper than updating two gauges on every call, and never out of step with it.)
        """
        self.registry.register(_AdmissionCollector(snapshot))

    def track_refusals(self, counts: dict[str, int]) -> None:
        """The front door's refusals (`Door.refused`, counted where it refuses), read at scrape."""
        self.registry.register(_RefusalsCollector(counts))

    def for_tool(self, tool: str) -> ToolMetrics:
        metrics = self.tools.get(tool)
        if metrics is None:
            metrics = self.tools[tool] = ToolMetrics.new()
        return metrics


class _CallsCollector(Collector):
    def __init__(self, tools: dict[str, ToolMetrics]) -> None:
        self.tools = tools

    def collect(self) -> Iterator[HistogramMetricFamily | CounterMetricFamily]:
        bounds = [*(floatToGoString(b) for b in LATENCY_BUCKETS), "+Inf"]
        for i, (name, doc) in enumerate(HISTOGRAMS):
            family = HistogramMetricFamily(name, doc, labels=["tool"])
            for tool, metrics in self.tools.items():
                histogram = metrics.histograms()[i]
                cumulative, buckets = 0, []
                for bound, count in zip(bounds, histogram.counts, strict=True):
                    cumulative += count
                    buckets.append((bound, cumulative))
                family.add_metric([tool], buckets, histogram.sum)
            yield family
        calls = CounterMetricFamily("toolenv_gateway_calls", CALLS_HELP, labels=["tool", "outcome"])
        hedged = CounterMetricFamily(
            "toolenv_gateway_hedged", "Hedge attempts sent.", labels=["tool"]
        )
        retried = CounterMetricFamily(
            "toolenv_gateway_retried",
            "Retries after a connection error, or (idempotent tools) after a call broken "
            "mid-request.",
            labels=["tool"],
        )
        for tool, metrics in self.tools.items():
            for outcome, counter in metrics.outcomes.items():
                calls.add_metric([tool, outcome], counter.value)
            hedged.add_metric([tool], metrics.hedged.value)
            retried.add_metric([tool], metrics.retried.value)
        yield calls
        yield hedged
        yield retried


class _AdmissionCollector(Collector):
    def __init__(self, snapshot: Callable[[], Iterable[tuple[str, int, int]]]) -> None:
        self.snapshot = snapshot

    def collect(self):
        in_flight = GaugeMetricFamily(
            "toolenv_gateway_in_flight", "Calls holding a concurrency slot.", labels=["tool"]
        )
        queued = GaugeMetricFamily(
            "toolenv_gateway_queued", "Calls waiting for a concurrency slot.", labels=["tool"]
        )
        for tool, running, waiting in self.snapshot():
            in_flight.add_metric([tool], running)
            queued.add_metric([tool], waiting)
        yield in_flight
        yield queued


class _RefusalsCollector(Collector):
    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        refused = CounterMetricFamily("toolenv_gateway_refused", REFUSED_HELP, labels=["reason"])
        for reason, count in self.counts.items():
            refused.add_metric([reason], count)
        yield refused
