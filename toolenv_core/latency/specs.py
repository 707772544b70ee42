"""Latency model specs: a pydantic discriminated union on `kind`, each building a sampler.

A spec is plain data (JSON/YAML round-trip), so a fitted profile, a config value and a
`PUT /v1/emulators/{tool}/profile` body are the same object. Every spec can `build()` a sampler;
the closed-form ones also give their `cdf`, which the fitter, `describe` and the tests use.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import scipy  # submodules load on first use: `toolenv --help` no longer pays scipy.stats (0.9 s)
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from toolenv_core.fields import Integer, Number
from toolenv_core.polytrace.latencies import tool_latencies

from .faults import Fault
from .samplers import (
    DriftSampler,
    FaultySampler,
    FunctionSampler,
    InterpolatedSampler,
    MixtureSampler,
    Sampler,
    TraceSampler,
    truncnormal_fn,
)

# Every number of a profile is finite: an infinite delay would sleep forever and could not be
# written back as JSON (`GET .../profile`); NaN passes no bound.
_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False)

Clock = Callable[[], float]


class _Spec(BaseModel):
    model_config = _STRICT

    def build(self, clock: Clock = time.monotonic) -> Sampler:
        """The sampler; `clock` is what a drift by time reads (a virtual-time rollout passes its
        own: on the wall clock a drift never left its first stage there)."""
        raise NotImplementedError

    def cdf(self, x: np.ndarray) -> np.ndarray:
        """P(delay <= x); raises for models whose distribution depends on time or order."""
        raise NotImplementedError(f"{type(self).__name__} has no closed-form CDF")


class _Parametric(_Spec):
    max_s: Number | None = Field(
        default=None, gt=0, description="clip samples at this many seconds"
    )

    def frozen(self):  # the scipy distribution with the same law (before clipping)
        raise NotImplementedError

    def cdf(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        out = self.frozen().cdf(x)
        if self.max_s is not None:
            out = np.where(x >= self.max_s, 1.0, out)
        return out

    def build(self, clock: Clock = time.monotonic) -> Sampler:
        return FunctionSampler(self._fn(), self.max_s)

    def _fn(self):
        raise NotImplementedError


class Constant(_Spec):
    kind: Literal["constant"] = "constant"
    value_s: Number = Field(ge=0)

    def build(self, clock: Clock = time.monotonic) -> Sampler:
        v = self.value_s
        return FunctionSampler(lambda rng: v, None)

    def cdf(self, x: np.ndarray) -> np.ndarray:
        return (np.asarray(x, dtype=float) >= self.value_s).astype(float)


class Uniform(_Parametric):
    kind: Literal["uniform"] = "uniform"
    low_s: Number = Field(ge=0)
    high_s: Number = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Uniform:
        if self.high_s < self.low_s:
            raise ValueError("high_s must be >= low_s")
        return self

    def frozen(self):
        return scipy.stats.uniform(loc=self.low_s, scale=self.high_s - self.low_s)

    def _fn(self):
        lo, hi = self.low_s, self.high_s
        return lambda rng: rng.uniform(lo, hi)


class TruncNormal(_Parametric):
    kind: Literal["truncnormal"] = "truncnormal"
    mean_s: Number
    std_s: Number = Field(gt=0)
    low_s: Number = Field(default=0.0, ge=0)
    high_s: Number | None = Field(default=None, description="upper bound (none: unbounded)")

    @model_validator(mode="after")
    def _ordered(self) -> TruncNormal:
        if self.high_s is not None and self.high_s <= self.low_s:
            raise ValueError("high_s must be > low_s")
        return self

    def _high(self) -> float:
        return math.inf if self.high_s is None else self.high_s

    def frozen(self):
        a = (self.low_s - self.mean_s) / self.std_s
        b = (self._high() - self.mean_s) / self.std_s
        return scipy.stats.truncnorm(a, b, loc=self.mean_s, scale=self.std_s)

    def _fn(self):
        return truncnormal_fn(self.mean_s, self.std_s, self.low_s, self._high())


class LogNormal(_Parametric):
    kind: Literal["lognormal"] = "lognormal"
    median_s: Number = Field(gt=0)
    sigma: Number = Field(gt=0, description="standard deviation of log(delay)")

    def frozen(self):
        return scipy.stats.lognorm(s=self.sigma, scale=self.median_s)

    def _fn(self):
        m, s = self.median_s, self.sigma
        return lambda rng: m * math.exp(s * rng.standard_normal())


class Gamma(_Parametric):
    kind: Literal["gamma"] = "gamma"
    shape: Number = Field(gt=0)
    scale_s: Number = Field(gt=0)

    def frozen(self):
        return scipy.stats.gamma(a=self.shape, scale=self.scale_s)

    def _fn(self):
        k, th = self.shape, self.scale_s
        return lambda rng: rng.gamma(k, th)


class Exponential(_Parametric):
    kind: Literal["exponential"] = "exponential"
    mean_s: Number = Field(gt=0)

    def frozen(self):
        return scipy.stats.expon(scale=self.mean_s)

    def _fn(self):
        m = self.mean_s
        return lambda rng: rng.exponential(m)


class Lomax(_Parametric):
    """Pareto type II: a heavy tail starting at 0 (`scale_s * numpy's pareto(shape)`)."""

    kind: Literal["lomax"] = "lomax"
    shape: Number = Field(gt=0, description="tail index alpha")
    scale_s: Number = Field(gt=0)

    def frozen(self):
        return scipy.stats.lomax(c=self.shape, scale=self.scale_s)

    def _fn(self):
        a, s = self.shape, self.scale_s
        return lambda rng: s * rng.pareto(a)


class Pareto(_Parametric):
    """Pareto type I: never faster than `scale_s`, power-law tail beyond."""

    kind: Literal["pareto"] = "pareto"
    shape: Number = Field(gt=0, description="tail index alpha")
    scale_s: Number = Field(gt=0, description="minimum delay")

    def frozen(self):
        return scipy.stats.pareto(b=self.shape, scale=self.scale_s)

    def _fn(self):
        a, s = self.shape, self.scale_s
        return lambda rng: s * (1.0 + rng.pareto(a))


class Empirical(_Spec):
    """Inverse-CDF interpolation through recorded samples or a quantile table.

    `quantiles` is a list of `[probability, seconds]` pairs from probability 0 to 1 (a fitted
    profile stores 0.1% steps plus finer points in the tail); `samples` is raw data.
    """

    kind: Literal["empirical"] = "empirical"
    samples: list[Number] | None = None
    quantiles: list[tuple[Number, Number]] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Empirical:
        if (self.samples is None) == (self.quantiles is None):
            raise ValueError("give exactly one of samples or quantiles")
        if self.samples is not None:
            if len(self.samples) < 1 or any(not math.isfinite(v) or v < 0 for v in self.samples):
                raise ValueError("samples must be a non-empty list of finite non-negative seconds")
        return self

    @field_validator("quantiles")
    @classmethod
    def _table(cls, value: list[tuple[float, float]] | None) -> list[tuple[float, float]] | None:
        if value is None:
            return value
        if len(value) < 2:
            raise ValueError("needs at least two [probability, seconds] points")
        ps = [p for p, _ in value]
        xs = [x for _, x in value]
        if ps[0] != 0.0 or ps[-1] != 1.0:
            raise ValueError("probabilities must start at 0 and end at 1")
        if any(b <= a for a, b in zip(ps, ps[1:], strict=False)):
            raise ValueError("probabilities must increase strictly")
        if any(b < a for a, b in zip(xs, xs[1:], strict=False)) or xs[0] < 0:
            raise ValueError("seconds must be non-negative and non-decreasing")
        return value

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        if self.quantiles is not None:
            arr = np.asarray(self.quantiles, dtype=float)
            return arr[:, 0], arr[:, 1]
        xs = np.sort(np.asarray(self.samples, dtype=float))
        if xs.size == 1:
            return np.array([0.0, 1.0]), np.array([xs[0], xs[0]])
        return np.linspace(0.0, 1.0, xs.size), xs

    def build(self, clock: Clock = time.monotonic) -> Sampler:
        return InterpolatedSampler(*self.table())

    def cdf(self, x: np.ndarray) -> np.ndarray:
        ps, xs = self.table()
        x = np.asarray(x, dtype=float)
        # Right-continuous inverse of the interpolated quantile function.
        idx = np.searchsorted(xs, x, side="right")
        out = np.interp(x, xs, ps)
        out = np.where(idx >= xs.size, 1.0, out)
        return np.where(idx == 0, 0.0, out)


class TraceReplay(_Spec):
    """Recorded latencies replayed in order (step, trajectory, turn), looping at the end.

    Inline `values_s`, or `paths` to PolyTrace files read when the sampler is built.
    """

    kind: Literal["trace"] = "trace"
    values_s: list[Number] | None = None
    paths: list[str] | None = Field(default=None, min_length=1)  # []: "no calls ... in : "
    tool: str = "search"
    start: Integer = Field(default=0, ge=0, description="index of the first call replayed")

    @model_validator(mode="after")
    def _one_source(self) -> TraceReplay:
        if (self.values_s is None) == (self.paths is None):
            raise ValueError("give exactly one of values_s or paths")
        if self.values_s is not None and not self.values_s:
            raise ValueError("values_s must not be empty")
        return self

    def values(self) -> np.ndarray:
        if self.values_s is not None:
            return np.asarray(self.values_s, dtype=float)

        paths = [Path(p) for p in self.paths or []]
        return tool_latencies(paths, self.tool, chooser="the trace model's `tool`")

    def build(self, clock: Clock = time.monotonic) -> Sampler:
        return TraceSampler(self.values(), self.start)

    def cdf(self, x: np.ndarray) -> np.ndarray:
        v = np.sort(self.values())
        return np.searchsorted(v, np.asarray(x, dtype=float), side="right") / v.size


class MixtureComponent(BaseModel):
    model_config = _STRICT
    weight: Number = Field(gt=0)
    model: LatencyModel


class Mixture(_Spec):
    kind: Literal["mixture"] = "mixture"
    components: list[MixtureComponent] = Field(min_length=1)

    def build(self, clock: Clock = time.monotonic) -> Sampler:
        return MixtureSampler(
            [c.weight for c in self.components], [c.model.build(clock) for c in self.components]
        )

    def cdf(self, x: np.ndarray) -> np.ndarray:
        top = max(c.weight for c in self.components)  # as the sampler: no sum overflows to inf
        total = sum(c.weight / top for c in self.components)
        return sum(c.weight / top / total * c.model.cdf(x) for c in self.components)


class DriftStage(BaseModel):
    model_config = _STRICT
    start: Number = Field(
        ge=0, description="first step (by=step) or second (by=time) of this stage"
    )
    model: LatencyModel


class Drift(_Spec):
    """A schedule of models: by training step or by seconds since the profile became active.

    By step, the step is the caller's (`step` in the request) or, without one, the number of
    calls so far divided by `calls_per_step` (every call of the profile, also those a mixture or
    an outer drift gave another part: `Sampler.skip`). `period` repeats the schedule.
    """

    kind: Literal["drift"] = "drift"
    by: Literal["step", "time"] = "step"
    schedule: list[DriftStage] = Field(min_length=1)
    period: Number | None = Field(default=None, gt=0)
    calls_per_step: Integer | None = Field(default=None, ge=1)

    @field_validator("schedule")
    @classmethod
    def _ordered(cls, value: list[DriftStage]) -> list[DriftStage]:
        starts = [s.start for s in value]
        if starts[0] != 0:
            raise ValueError("the first stage must start at 0")
        if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
            raise ValueError("stage starts must increase strictly")
        return value

    def build(self, clock: Clock = time.monotonic) -> Sampler:
        return DriftSampler(
            self.by,
            [s.start for s in self.schedule],
            [s.model.build(clock) for s in self.schedule],
            self.period,
            self.calls_per_step,
            clock,
        )


class Faulty(_Spec):
    """Any model plus faults (error with a status, hang, 429 with Retry-After, slow body)."""

    kind: Literal["faulty"] = "faulty"
    model: LatencyModel
    faults: list[Fault] = Field(default_factory=list)

    @field_validator("faults")
    @classmethod
    def _rates(cls, value: list) -> list:
        if sum(f.rate for f in value) > 1.0 + 1e-12:
            raise ValueError("fault rates must add up to at most 1")
        return value

    def build(self, clock: Clock = time.monotonic) -> Sampler:
        return FaultySampler(self.model.build(clock), self.faults)

    def cdf(self, x: np.ndarray) -> np.ndarray:
        return self.model.cdf(x)


LatencyModel = Annotated[
    Constant
    | Uniform
    | TruncNormal
    | LogNormal
    | Gamma
    | Exponential
    | Lomax
    | Pareto
    | Empirical
    | TraceReplay
    | Mixture
    | Drift
    | Faulty,
    Field(discriminator="kind"),
]

for _cls in (MixtureComponent, Mixture, DriftStage, Drift, Faulty):
    _cls.model_rebuild()
