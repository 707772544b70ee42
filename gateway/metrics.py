"""Prometheus metrics of one gateway app, in the app's own registry (no global state)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# From 0.5 ms (the gateway's own overhead) to 5 minutes (a long sandbox run).
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip

OUTCOMES = ("ok", "error", "timeout", "rejected", "unavailable", "upstream_failed")


@dataclass(slots=True)
class ToolMetrics:
    """The children of every metric for one tool, looked up once (labels() is not free)."""

    queue_wait: object
    upstream: object
    injected_delay: object
    total: object
    outcomes: dict[str, object]
    hedged: object
    retried: object


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.queue_wait = Histogram(
            "toolenv_gateway_queue_wait_seconds", "Time a call waited for a concurrency slot.",
            ["tool"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.upstream = Histogram(
            "toolenv_gateway_upstream_seconds", "Time from sending to the upstream to its answer (winning attempt).",
            ["tool"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.injected_delay = Histogram(
            "toolenv_gateway_injected_delay_seconds", "Delay the emulators report injecting (X-Toolenv-Injected-Delay-Ms).",
            ["tool"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.total = Histogram(
            "toolenv_gateway_call_seconds", "Whole call as the caller sees it (queue + upstream + gateway).",
            ["tool"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.outcomes = Counter(
            "toolenv_gateway_calls", "Calls by outcome: ok, error (upstream answered an error), timeout, "
            "rejected (429), unavailable (503), upstream_failed (502).",
            ["tool", "outcome"], registry=r,
        )  # fmt: skip
        self.hedged = Counter(
            "toolenv_gateway_hedged", "Hedge attempts sent.", ["tool"], registry=r
        )
        self.retried = Counter(
            "toolenv_gateway_retried", "Retries after a connection error.", ["tool"], registry=r
        )

    def track_admission(self, snapshot: Callable[[], Iterable[tuple[str, int, int]]]) -> None:
        """In-flight and queued gauges, read from the admission state at scrape time.

        (Cheaper than updating two gauges on every call, and never out of step with it.)
        """
        self.registry.register(_AdmissionCollector(snapshot))

    def for_tool(self, tool: str) -> ToolMetrics:
        return ToolMetrics(
            queue_wait=self.queue_wait.labels(tool),
            upstream=self.upstream.labels(tool),
            injected_delay=self.injected_delay.labels(tool),
            total=self.total.labels(tool),
            outcomes={o: self.outcomes.labels(tool, o) for o in OUTCOMES},
            hedged=self.hedged.labels(tool),
            retried=self.retried.labels(tool),
        )


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
