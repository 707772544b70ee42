"""Ramp: step an open-loop rate up until an SLO breaks; the knee is the last rate that held."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .loop import run_load
from .result import LoadResult
from .slo import SLO, SLOVerdict, check_all
from .spec import HARD_MAX_RATE, LoadSpec

DEFAULT_RAMP_SLOS = ("p99=1s", "errors=1%", "rate=95%")
MAX_RAMP_STEPS = 100  # each a whole run of --step-duration


@dataclass
class RampStep:
    rate: float
    result: LoadResult
    summary: dict[str, Any]
    verdicts: list[SLOVerdict]

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts)

    @property
    def interrupted(self) -> bool:
        """Cut short by Ctrl-C: its verdicts are of part of a step."""
        return self.result.interrupted


@dataclass
class RampResult:
    steps: list[RampStep] = field(default_factory=list)

    @property
    def knee_rate(self) -> float | None:
        """The highest rate whose whole step met every SLO (None if the first step already broke).
        A step cut short by Ctrl-C is not one: it made the knee of a ramp that "never broke"."""
        passing = [s.rate for s in self.steps if s.ok and not s.interrupted]
        return max(passing) if passing else None

    @property
    def interrupted_at(self) -> float | None:
        return self.steps[-1].rate if self.steps and self.steps[-1].interrupted else None

    @property
    def broke_at(self) -> float | None:
        broken = [s.rate for s in self.steps if not s.ok]
        return broken[0] if broken else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "knee_rate": self.knee_rate,
            "broke_at": self.broke_at,
            "interrupted_at": self.interrupted_at,
            "steps": [
                {
                    "rate": s.rate,
                    "ok": s.ok,
                    "interrupted": s.interrupted,
                    "achieved_rate": s.summary["achieved_rate"],
                    "throughput": s.summary["throughput"],
                    "error_rate": s.summary["error_rate"],
                    "ok_corrected_ms": s.summary["outcomes"].get("ok", {}).get("corrected_ms"),
                    "slos": [v.as_dict() for v in s.verdicts],
                }
                for s in self.steps
            ],
        }


def ramp_rates(start: float, *, factor: float, step: float, max_rate: float) -> list[float]:
    """Rates from `start` to `max_rate`: multiply by `factor` (> 1) or add `step` (> 0)."""
    if not all(math.isfinite(x) for x in (start, factor, step, max_rate)):
        # a NaN passed every check below: a one-step ramp reported "never broke", exit 0
        raise ValueError("--rate, --ramp-factor, --ramp-step and --ramp-max must be finite")
    if start <= 0:
        raise ValueError(f"--rate must be above 0 rps to start a ramp from, got {start:g}")
    if max_rate < start:
        raise ValueError(
            f"the ramp starts at --rate {start:g} rps, above --ramp-max {max_rate:g}: "
            "raise --ramp-max or lower --rate"
        )
    if max_rate >= HARD_MAX_RATE:  # a traceback at the first step past it, the steps before lost
        raise ValueError(f"--ramp-max must be below {HARD_MAX_RATE:,} rps, got {max_rate:g}")
    if step < 0:  # ignored before: the ramp multiplied by the factor instead
        raise ValueError(f"--ramp-step must be >= 0 rps, got {step:g}")
    if factor <= 1.0 and step <= 0:
        raise ValueError("ramp needs --ramp-factor > 1 or --ramp-step > 0")
    rates, rate = [], start
    while rate <= max_rate * (1 + 1e-9):
        if len(rates) == MAX_RAMP_STEPS:  # cut there, it read "never broke" below --ramp-max
            how = f"--ramp-step {step:g}" if step > 0 else f"--ramp-factor {factor:g}"
            raise ValueError(
                f"the ramp from --rate {start:g} to --ramp-max {max_rate:g} rps by {how} takes "
                f"more than {MAX_RAMP_STEPS} steps: take larger steps or a narrower range"
            )
        rates.append(round(rate, 3))
        rate = rate + step if step > 0 else rate * factor
    return rates


def run_ramp(
    spec: LoadSpec,
    rates: list[float],
    slos: list[SLO],
    *,
    step_duration_s: float,
    on_step: Callable[[RampStep], None] | None = None,
) -> RampResult:
    """Run one open-loop step per rate (each bounded like any run) and stop at the first break."""
    if spec.arrival == "closed":
        raise ValueError("a ramp steps an open-loop rate: use --arrival constant or poisson")
    ramp = RampResult()
    for rate in rates:
        step_spec = dataclasses.replace(spec, rate=rate, duration_s=step_duration_s)
        result = run_load(step_spec)
        summary = result.summary()
        step = RampStep(rate, result, summary, check_all(slos, summary))
        ramp.steps.append(step)
        if on_step is not None:
            on_step(step)
        if not step.ok or result.interrupted:
            break
    return ramp
