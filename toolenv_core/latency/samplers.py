"""Runtime samplers: what a latency spec builds. `sample(rng) -> seconds`, `draw(rng) -> Draw`.

Samplers hold no random state of their own: the caller passes a seeded `numpy.random.Generator`,
so one seed reproduces a whole run. The trace and drift samplers keep a position (the next
recorded call, the clock they started on), which is what replay and drift mean.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import scipy

from .faults import Fault


@dataclass(frozen=True, slots=True)
class Draw:
    """One call's fate: how long it takes and which fault (if any) it suffers."""

    delay_s: float
    fault: Fault | None = None


class Sampler:
    """Base: `sample` gives seconds; `draw` adds the fault (none unless wrapped by `faulty`)."""

    counts_calls = False  # a drift by call count, or a sampler holding one (`skip`)

    def skip(self) -> None:
        """A call went to another part of the profile (a mixture's other component, a drift's
        other stage): a drift that counts calls counts it too, as "calls so far" says."""

    def sample(self, rng: np.random.Generator, step: int | None = None) -> float:
        raise NotImplementedError

    def draw(self, rng: np.random.Generator, step: int | None = None) -> Draw:
        return Draw(self.sample(rng, step))

    def sample_many(self, rng: np.random.Generator, n: int, step: int | None = None) -> np.ndarray:
        return np.fromiter((self.sample(rng, step) for _ in range(n)), dtype=float, count=n)


class FunctionSampler(Sampler):
    """A parametric distribution: `fn(rng) -> float`, clipped to `[0, max_s]`."""

    def __init__(self, fn: Callable[[np.random.Generator], float], max_s: float | None) -> None:
        self._fn = fn
        self._max = math.inf if max_s is None else max_s

    def sample(self, rng: np.random.Generator, step: int | None = None) -> float:
        try:
            value = float(self._fn(rng))
        except OverflowError:  # exp() past the float range (a huge sigma): an unbounded delay
            value = math.inf
        return min(max(0.0, value), self._max)


def truncnormal_fn(
    mean: float, std: float, low: float, high: float
) -> Callable[[np.random.Generator], float]:
    """Inverse-CDF sampling of a normal restricted to [low, high] (fast, no rejection loop).

    In log space, and on the lower side of the mean (an interval above it is sampled as its
    mirror image): a bound ~8 standard deviations out rounded the normal CDF to exactly 0 or 1,
    and every draw became infinite (a `low_s` above the mean: `max_delay_s` per call) or `low_s`.
    """
    alpha, beta = (low - mean) / std, (high - mean) / std
    sign = -1.0 if alpha > 0 else 1.0  # an upper tail: sample its mirror, a lower one
    lo, hi = (-beta, -alpha) if sign < 0 else (alpha, beta)
    log_hi = float(scipy.special.log_ndtr(hi))
    ratio = math.exp(float(scipy.special.log_ndtr(lo)) - log_hi)  # P(Z <= lo) / P(Z <= hi)
    ndtri_exp = scipy.special.ndtri_exp  # looked up once, not per draw

    def fn(rng: np.random.Generator) -> float:
        r = rng.random()  # u = P(Z <= lo) + r * (P(Z <= hi) - P(Z <= lo)), as a log
        log_u = log_hi + math.log(max(r + (1.0 - r) * ratio, 1e-300))
        return float(np.clip(mean + sign * std * ndtri_exp(log_u), low, high))

    return fn


class InterpolatedSampler(Sampler):
    """Inverse-CDF sampling through a piecewise-linear quantile function (probabilities -> values)."""

    def __init__(self, probabilities: np.ndarray, values: np.ndarray) -> None:
        self._p = probabilities
        self._x = values

    def sample(self, rng: np.random.Generator, step: int | None = None) -> float:
        return float(np.interp(rng.random(), self._p, self._x))

    def sample_many(self, rng: np.random.Generator, n: int, step: int | None = None) -> np.ndarray:
        return np.interp(rng.random(n), self._p, self._x)


class TraceSampler(Sampler):
    """Replays recorded latencies in order (step, trajectory, turn), looping at the end."""

    def __init__(self, values: np.ndarray, start: int = 0) -> None:
        self._values = values
        self._next = start % len(values)

    def sample(self, rng: np.random.Generator, step: int | None = None) -> float:
        value = float(self._values[self._next])
        self._next = (self._next + 1) % len(self._values)
        return value


class MixtureSampler(Sampler):
    def __init__(self, weights: Sequence[float], components: Sequence[Sampler]) -> None:
        w = np.asarray(weights, dtype=float)
        w = w / w.max()  # first: weights near the float maximum would sum to inf
        self._cum = np.cumsum(w / w.sum())
        self._components = list(components)
        self.counts_calls = any(c.counts_calls for c in self._components)

    def _pick(self, rng: np.random.Generator) -> Sampler:
        index = int(np.searchsorted(self._cum, rng.random(), side="right"))
        picked = self._components[min(index, len(self._components) - 1)]
        if self.counts_calls:  # a drift in another component counted only its own share
            for component in self._components:
                if component is not picked:
                    component.skip()
        return picked

    def skip(self) -> None:
        for component in self._components:
            component.skip()

    def sample(self, rng: np.random.Generator, step: int | None = None) -> float:
        return self._pick(rng).sample(rng, step)

    def draw(self, rng: np.random.Generator, step: int | None = None) -> Draw:
        return self._pick(rng).draw(rng, step)


class DriftSampler(Sampler):
    """A schedule of samplers: by training step (given, or counted in calls) or by elapsed time."""

    def __init__(
        self,
        by: str,
        starts: Sequence[float],
        stages: Sequence[Sampler],
        period: float | None,
        calls_per_step: int | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._by = by
        self._starts = np.asarray(starts, dtype=float)
        self._stages = list(stages)
        self._period = period
        self._calls_per_step = calls_per_step
        self._clock = clock
        self._t0 = clock()
        self._calls = 0
        self.counts_calls = bool(calls_per_step) or any(s.counts_calls for s in self._stages)

    def position(self, step: int | None) -> float:
        """Where on the schedule this call falls (a step number or seconds since start)."""
        if self._by == "time":
            x = self._clock() - self._t0
        elif step is not None:
            x = float(step)
        elif self._calls_per_step:
            x = float(self._calls // self._calls_per_step)
        else:
            x = 0.0
        if self._period:
            x = x % self._period
        return x

    def stage(self, step: int | None) -> Sampler:
        index = int(np.searchsorted(self._starts, self.position(step), side="right")) - 1
        self._calls += 1
        stage = self._stages[max(index, 0)]
        if self.counts_calls:
            for other in self._stages:
                if other is not stage:
                    other.skip()
        return stage

    def skip(self) -> None:
        self._calls += 1
        for stage in self._stages:
            stage.skip()

    def sample(self, rng: np.random.Generator, step: int | None = None) -> float:
        return self.stage(step).sample(rng, step)

    def draw(self, rng: np.random.Generator, step: int | None = None) -> Draw:
        return self.stage(step).draw(rng, step)


class FaultySampler(Sampler):
    """Any sampler plus faults: one uniform draw per call against the cumulative fault rates."""

    def __init__(self, inner: Sampler, faults: Sequence[Fault]) -> None:
        self._inner = inner
        self._faults = list(faults)
        self._cum = np.cumsum([f.rate for f in faults]) if faults else np.zeros(0)
        self.counts_calls = inner.counts_calls

    def skip(self) -> None:
        self._inner.skip()

    def sample(self, rng: np.random.Generator, step: int | None = None) -> float:
        return self.draw(rng, step).delay_s

    def draw(self, rng: np.random.Generator, step: int | None = None) -> Draw:
        inner = self._inner.draw(rng, step)
        u = rng.random()
        index = int(np.searchsorted(self._cum, u, side="right"))
        if index < len(self._faults):
            return Draw(inner.delay_s, self._faults[index])
        return inner
