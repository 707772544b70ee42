"""SLO flags (`--slo p99=500ms --slo errors=0.1%`) and their verdicts, for CI exit codes.

Grammar: `<metric>=<limit>`.
- latency metrics `p50`, `p90`, `p99`, `p99.9`, `max`, `mean`: a duration with unit `us`, `ms`
  or `s` (bare numbers are ms); checked against successful requests' latency measured from the
  scheduled send time (the honest figure). A run with no successful request breaks them.
- `errors` and `timeouts`: the share of requests that did not succeed / timed out, as `0.1%` or
  a fraction `0.001`; the limit is inclusive.
- `rate`: the rate actually sent must reach this share of the target (`rate=95%`, at most 100%),
  open loop only: below it the generator (or its connection limit) could not keep up.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

LATENCY_METRICS = ("p50", "p90", "p99", "p99.9", "max", "mean")
SHARE_METRICS = ("errors", "timeouts", "rate")
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(us|µs|ms|s)?\s*$")
_SHARE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(%)?\s*$")


class SLOError(ValueError):
    """An SLO flag does not parse."""


@dataclass(frozen=True, slots=True)
class SLO:
    metric: str
    limit: float  # ms for latency metrics, a fraction for shares
    text: str

    @classmethod
    def parse(cls, text: str) -> SLO:
        if "=" not in text:
            raise SLOError(f"SLO {text!r} must look like p99=500ms or errors=0.1%")
        metric, value = (part.strip() for part in text.split("=", 1))
        metric = metric.lower()
        if metric in LATENCY_METRICS:
            m = _DURATION.match(value)
            if not m:
                raise SLOError(f"SLO {text!r}: {value!r} is not a duration like 500ms, 2s or 800us")
            scale = {"us": 0.001, "µs": 0.001, "ms": 1.0, "s": 1000.0, None: 1.0}[m.group(2)]
            return cls(metric, float(m.group(1)) * scale, text)
        if metric in SHARE_METRICS:
            m = _SHARE.match(value)
            if not m:
                raise SLOError(f"SLO {text!r}: {value!r} is not a share like 0.1% or 0.001")
            share = float(m.group(1)) / (100.0 if m.group(2) else 1.0)
            if share > 1.0:
                # Errors can never exceed every request; a sent rate cannot beat its schedule.
                never = "met" if metric == "rate" else "broken"
                raise SLOError(f"SLO {text!r}: a share above 100% can never be {never}")
            return cls(metric, share, text)
        known = ", ".join(LATENCY_METRICS + SHARE_METRICS)
        raise SLOError(f"SLO {text!r}: unknown metric {metric!r}; known: {known}")

    def actual(self, summary: dict[str, Any]) -> float:
        if self.metric in LATENCY_METRICS:
            ok = summary["outcomes"].get("ok")
            return ok["corrected_ms"][self.metric] if ok else math.nan
        if self.metric == "errors":
            return summary["error_rate"]
        if self.metric == "timeouts":
            return summary["timeout_rate"]
        target = summary.get("target_rate")
        return summary["achieved_rate"] / target if target else math.nan

    def check(self, summary: dict[str, Any]) -> SLOVerdict:
        value = self.actual(summary)
        if self.metric == "rate":
            ok = not math.isnan(value) and value >= self.limit
        else:
            ok = not math.isnan(value) and value <= self.limit
        return SLOVerdict(self, value, ok)

    def format(self, value: float) -> str:
        if math.isnan(value):
            return "n/a"
        if self.metric in LATENCY_METRICS:
            return f"{value:.1f} ms"
        return f"{value * 100:.3g}%"

    @property
    def bound(self) -> str:
        op = ">=" if self.metric == "rate" else "<="
        return f"{self.metric} {op} {self.format(self.limit)}"


@dataclass(frozen=True, slots=True)
class SLOVerdict:
    slo: SLO
    actual: float
    ok: bool

    def as_dict(self) -> dict[str, Any]:
        return {
            "slo": self.slo.text,
            "metric": self.slo.metric,
            "limit": self.slo.limit,
            "actual": None if math.isnan(self.actual) else self.actual,
            "ok": self.ok,
        }


def check_all(slos: list[SLO], summary: dict[str, Any]) -> list[SLOVerdict]:
    return [slo.check(summary) for slo in slos]
