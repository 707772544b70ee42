"""Fit latency models to recorded calls and pick the one to ship as a profile.

Candidates: lognormal, gamma, exponential, truncated normal, Lomax (scipy MLE, location fixed at
0), mixtures of 2 and 3 lognormals (EM on log-latency), and the empirical quantile table. Each is
scored by the KS distance to the data and the relative error at p50/p90/p99/p99.9.

Choice: the parametric candidate with the smallest KS distance wins if the data cannot tell it
apart from the model (KS below the 5% critical value 1.358/sqrt(n)); otherwise the empirical
quantile table wins, because then every closed form misses the recorded shape somewhere.

Only successful calls are fitted (`split_by_status`): a timed-out call's latency is its deadline,
an error's how fast the tool failed, and a call whose caller left says nothing of the tool. Errors
and timeouts become the profile's faults at the rate recorded (an `error` fault, a `hang`, which
times out under the same deadline); every other status is left out and counted.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import scipy

from toolenv_core.console import counted
from toolenv_core.latency.faults import ErrorFault, Fault, HangFault
from toolenv_core.latency.profile import Profile
from toolenv_core.latency.specs import (
    Drift,
    DriftStage,
    Empirical,
    Exponential,
    Faulty,
    Gamma,
    LogNormal,
    Lomax,
    Mixture,
    MixtureComponent,
    TruncNormal,
)
from toolenv_core.polytrace.latencies import LatencyObservation, iter_latencies, no_calls_message

REPORT_QUANTILES = (0.5, 0.9, 0.99, 0.999)
OK_STATUS = "success"  # an answered call, as PolyTrace, the gateway capture and rollouts record it
FAULT_OF_STATUS: dict[str, type[ErrorFault] | type[HangFault]] = {
    "error": ErrorFault,  # the tool answered an error (the capture keeps no HTTP status: 503)
    "timeout": HangFault,  # cut at the caller's deadline: a hang times out under the same one
}


@dataclass
class StatusSplit:
    """Recorded calls by status: the successful ones to fit, the rest counted by status."""

    ok: list[LatencyObservation]
    carried: dict[str, int]  # status -> calls, carried as the profile's faults
    left_out: dict[str, int]  # status -> calls neither fitted nor carried

    def faults(self) -> list[Fault]:
        """Each carried status as its fault, at its share of the calls the tool answered or
        timed out on (left-out calls say nothing of the tool)."""
        seen = len(self.ok) + sum(self.carried.values())
        return [FAULT_OF_STATUS[s](rate=round(n / seen, 6)) for s, n in self.carried.items()]

    def as_dict(self) -> dict[str, Any]:
        return {
            "fitted": len(self.ok),
            "carried_as_faults": self.carried,
            "left_out": self.left_out,
        }

    def describe(self) -> str:
        """What was fitted, carried and left out, for the human report."""
        parts = [f"latency fitted on {counted(len(self.ok), 'successful call')}"]
        if self.carried:
            carried = zip(self.carried.items(), self.faults(), strict=True)
            parts.append(
                "carried as faults: "
                + ", ".join(
                    f"{counted(n, f'{status} call')} ({fault.type}, rate {fault.rate:.4g})"
                    for (status, n), fault in carried
                )
            )
        if self.left_out:
            parts.append(
                "left out: "
                + ", ".join(
                    f"{counted(n, f'{status} call')}" for status, n in self.left_out.items()
                )
            )
        return "; ".join(parts)


def split_by_status(observations: list[LatencyObservation]) -> StatusSplit:
    """A call without a status (call logs, reward timings) is a successful one."""
    ok: list[LatencyObservation] = []
    carried: dict[str, int] = {}
    left_out: dict[str, int] = {}
    for o in observations:
        if o.status is None or o.status == OK_STATUS:
            ok.append(o)
        else:
            counts = carried if o.status in FAULT_OF_STATUS else left_out
            counts[o.status] = counts.get(o.status, 0) + 1
    return StatusSplit(ok, dict(sorted(carried.items())), dict(sorted(left_out.items())))


def successful_latencies(paths: list[Path], tool: str) -> np.ndarray:
    """The latencies `fit` fits (successful calls): what a profile is compared with (the
    profile's tool, which `describe` takes from it: it has no `--tool`)."""
    observations = list(iter_latencies(paths, tool))
    if not observations:
        raise ValueError(no_calls_message(paths, tool, "the profile's `tool`"))
    split = split_by_status(observations)
    if not split.ok:
        raise ValueError(f"no successful call of {tool!r} to compare with: {split.describe()}")
    return np.asarray([o.latency_s for o in split.ok])


@dataclass
class Candidate:
    name: str
    spec: Any
    ks: float
    quantile_errors: dict[str, float]
    parametric: bool
    error: str | None = None

    def row(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ks": self.ks,
            "quantile_errors": self.quantile_errors,
            "parametric": self.parametric,
            "error": self.error,
        }


@dataclass
class FitReport:
    tool: str
    n: int
    data_quantiles: dict[str, float]
    candidates: list[Candidate]
    best: Candidate
    reason: str
    ks_critical: float
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "tool": self.tool,
            "n": self.n,
            "data_quantiles": self.data_quantiles,
            "ks_critical_5pct": self.ks_critical,
            "best": self.best.name,
            "reason": self.reason,
            "candidates": [c.row() for c in self.candidates],
            **self.extra,
        }


def qname(p: float) -> str:
    return f"p{p * 100:g}"


def quantile_table_probabilities() -> np.ndarray:
    """0.1% steps, then finer steps in the tail where latency studies look."""
    body = np.round(np.arange(0, 1001) / 1000, 6)
    tail = np.round(0.999 + np.arange(1, 10) / 10000, 6)
    return np.unique(np.concatenate([body, tail, [1.0]]))


def empirical_table(data: np.ndarray, digits: int = 6) -> Empirical:
    ps = quantile_table_probabilities()
    xs = np.maximum.accumulate(np.round(np.quantile(data, ps), digits))
    return Empirical(quantiles=[(float(p), float(x)) for p, x in zip(ps, xs, strict=True)])


def model_quantiles(spec: Any, ps: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Quantiles of any model with a CDF, by inverting the CDF on a dense log grid."""
    grid = np.unique(
        np.concatenate(
            [np.geomspace(max(lo, 1e-7), max(hi, 1e-6), 20000), np.linspace(0, hi, 2000)]
        )
    )
    cdf = np.maximum.accumulate(np.clip(spec.cdf(grid), 0, 1))
    return np.interp(ps, cdf, grid)


def _lognormal_mixture(
    logx: np.ndarray, k: int, iters: int = 200
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """EM for a k-component Gaussian mixture on log-latency (weights, means, sigmas)."""
    qs = np.quantile(logx, (np.arange(k) + 0.5) / k)
    w = np.full(k, 1 / k)
    mu = qs.astype(float)
    sd = np.full(k, max(logx.std() / k, 1e-3))
    for _ in range(iters):
        dens = w * scipy.stats.norm.pdf(logx[:, None], mu, sd) + 1e-300
        r = dens / dens.sum(axis=1, keepdims=True)
        nk = r.sum(axis=0)
        w_new = nk / nk.sum()
        mu_new = (r * logx[:, None]).sum(axis=0) / nk
        sd_new = np.sqrt((r * (logx[:, None] - mu_new) ** 2).sum(axis=0) / nk).clip(1e-3)
        done = np.allclose(mu, mu_new, atol=1e-6) and np.allclose(sd, sd_new, atol=1e-6)
        w, mu, sd = w_new, mu_new, sd_new
        if done:
            break
    return w, mu, sd


def _candidates(data: np.ndarray) -> list[tuple[str, Any, bool]]:
    pos = data[data > 0]
    floor = float(pos.min()) if pos.size else 1e-6
    safe = np.maximum(data, floor)  # log-based fits need strictly positive data
    out: list[tuple[str, Any, bool]] = []

    def attempt(name: str, make) -> None:
        try:
            out.append((name, make(), True))
        except Exception as exc:  # a fit that does not converge is reported, not fatal
            out.append((name, exc, True))

    def lognormal():
        s, _, scale = scipy.stats.lognorm.fit(safe, floc=0)
        return LogNormal(median_s=float(scale), sigma=float(s))

    def gamma():
        a, _, scale = scipy.stats.gamma.fit(safe, floc=0)
        return Gamma(shape=float(a), scale_s=float(scale))

    def lomax():
        c, _, scale = scipy.stats.lomax.fit(data, floc=0)
        return Lomax(shape=float(c), scale_s=float(scale))

    def truncnormal():
        return TruncNormal(mean_s=float(data.mean()), std_s=float(max(data.std(), 1e-9)), low_s=0.0)

    def mixture(k: int):
        def make():
            w, mu, sd = _lognormal_mixture(np.log(safe), k)
            return Mixture(
                components=[
                    MixtureComponent(
                        weight=float(wi),
                        model=LogNormal(median_s=float(math.exp(m)), sigma=float(s)),
                    )
                    for wi, m, s in zip(w, mu, sd, strict=True)
                ]
            )

        return make

    attempt("lognormal", lognormal)
    attempt("gamma", gamma)
    attempt("exponential", lambda: Exponential(mean_s=float(max(data.mean(), 1e-9))))
    attempt("truncnormal", truncnormal)
    attempt("lomax", lomax)
    if data.size >= 50:
        attempt("lognormal_mixture_2", mixture(2))
        attempt("lognormal_mixture_3", mixture(3))
    out.append(("empirical_quantiles", empirical_table(data), False))
    return out


def ks_distance(data: np.ndarray, cdf: Any) -> float:
    """sup |ECDF - CDF| for any model CDF, its jumps included: on each distinct recorded value
    and just before it. scipy's `kstest` assumes a continuous CDF: on data with ties (latencies
    logged to 10 ms) the empirical table's own steps read as misfit (KS 0.12 for a table within
    0.001 of the data; 1.0 for calls that all took the same time)."""
    x = np.sort(np.asarray(data, dtype=float))
    u = np.unique(x)
    above = np.abs(np.searchsorted(x, u, side="right") / x.size - cdf(u))
    below = np.abs(np.searchsorted(x, u, side="left") / x.size - cdf(np.nextafter(u, -np.inf)))
    return float(max(above.max(), below.max()))


def score(data: np.ndarray, spec: Any) -> tuple[float, dict[str, float]]:
    ks = ks_distance(data, spec.cdf)
    ps = np.asarray(REPORT_QUANTILES)
    want = np.quantile(data, ps)
    got = model_quantiles(spec, ps, float(data.min()) / 10, float(data.max()) * 100)
    errors = {
        qname(p): float((g - w) / w) if w > 0 else 0.0
        for p, w, g in zip(ps, want, got, strict=True)
    }
    return ks, errors


def fit(data: np.ndarray, tool: str = "search") -> FitReport:
    data = np.asarray(data, dtype=float)
    if data.size < 2:
        raise ValueError(f"need at least 2 recorded calls of {tool!r} to fit, got {data.size}")
    candidates: list[Candidate] = []
    # scipy's numerical warnings on degenerate data (latencies of 0 s, all alike) went to stderr
    # as source lines of scipy; a fit that fails is reported in its row, one that strays by KS
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for name, spec, parametric in _candidates(data):
            if isinstance(spec, Exception):
                candidates.append(Candidate(name, None, math.inf, {}, parametric, error=str(spec)))
                continue
            ks, errors = score(data, spec)
            candidates.append(Candidate(name, spec, ks, errors, parametric))
    critical = 1.358 / math.sqrt(data.size)
    parametric = [c for c in candidates if c.parametric and c.spec is not None]
    best_parametric = min(parametric, key=lambda c: c.ks) if parametric else None
    empirical = next(c for c in candidates if c.name == "empirical_quantiles")
    if best_parametric is not None and best_parametric.ks <= critical:
        best = best_parametric
        reason = (
            f"{best.name} fits within the 5% KS critical value ({best.ks:.4f} <= {critical:.4f} for "
            f"n={data.size}): a closed form the data cannot tell apart, with a smooth tail"
        )
    else:
        best = empirical
        closest = (
            f"{best_parametric.name} KS {best_parametric.ks:.4f}" if best_parametric else "none"
        )
        reason = (
            f"no parametric candidate is within the 5% KS critical value {critical:.4f} for "
            f"n={data.size} (closest: {closest}); the empirical quantile table reproduces the "
            f"recorded shape (KS {empirical.ks:.4f})"
        )
    quantiles = {qname(p): float(np.quantile(data, p)) for p in REPORT_QUANTILES}
    quantiles.update(mean=float(data.mean()), max=float(data.max()), min=float(data.min()))
    return FitReport(tool, int(data.size), quantiles, candidates, best, reason, critical)


def per_step_drift(steps: np.ndarray, data: np.ndarray, fault_rate: float = 0.0) -> Drift:
    """One empirical stage per recorded step, switched by step (or by call count without one).

    `data` are the successful calls; the served profile counts every call, faults included
    (`fault_rate` of them), so a step's calls are its successes / (1 - fault_rate): counted
    without them, a trace with 15% errors moved on to the next stage 15% early."""
    stages = []
    unique = np.unique(steps)
    for i, step in enumerate(unique):
        stages.append(DriftStage(start=float(i), model=empirical_table(data[steps == step])))
    calls_per_step = max(1, round(data.size / (1.0 - fault_rate) / len(unique)))
    return Drift(
        by="step", schedule=stages, calls_per_step=calls_per_step, period=float(len(unique))
    )


def per_step_note(model: Any) -> str | None:
    """What a fit wrote instead of the candidate its report chose, when it wrote a `--per-step`
    drift (faults or not); None when it wrote that candidate."""
    inner = model.model if isinstance(model, Faulty) else model
    if not isinstance(inner, Drift):
        return None
    return (
        f"a drift of {len(inner.schedule)} empirical stage(s), one per recorded step, not the "
        "candidate the fit of all steps together chose"
    )


def token_table(tokens: np.ndarray) -> Empirical:
    """Per-query response tokens as a 1%-step quantile table."""
    ps = np.round(np.arange(0, 101) / 100, 2)
    xs = np.maximum.accumulate(np.round(np.quantile(tokens, ps), 1))
    return Empirical(quantiles=[(float(p), float(x)) for p, x in zip(ps, xs, strict=True)])


def build_profile(
    report: FitReport,
    *,
    source: str,
    observations: list | None = None,
    per_step: bool = False,
    faults: list[Fault] | None = None,
) -> Profile:
    """The profile a fit writes: the chosen model (with `faults`, when a status was carried as
    one), token sizes (search), scaling reference (reward)."""
    model = report.best.spec
    response_tokens = None
    reference: dict[str, float] = {}
    obs = observations or []
    if per_step and obs:
        steps = np.asarray([o.step for o in obs])
        data = np.asarray([o.latency_s for o in obs])
        model = per_step_drift(steps, data, sum(f.rate for f in faults or []))
    per_query = [
        o.response_tokens / o.query_count
        for o in obs
        if o.response_tokens is not None and o.query_count and o.query_count > 0
    ]
    if per_query:
        response_tokens = token_table(np.asarray(per_query))
        reference["topk"] = 3.0
    batches = [o for o in obs if o.batch_size]
    if batches:
        reference["batch_size"] = float(np.median([o.batch_size for o in batches]))
        reference["response_mean"] = float(
            np.mean([o.response_sum / o.batch_size for o in batches])
        )
    summary = report.as_dict()
    summary["candidates"] = [
        {
            "name": c.name,
            "ks": round(c.ks, 5),
            **{k: round(v, 4) for k, v in c.quantile_errors.items()},
        }
        for c in report.candidates
        if c.spec is not None
    ]
    if faults:
        model = Faulty(model=model, faults=faults)
    # a `--per-step` drift's notes said "chose truncnormal", the candidate it was not
    drift = per_step_note(model)
    notes = f"written by `toolenv emulators fit`; chose {report.best.name}: {report.reason}"
    if drift is not None:
        notes = f"written by `toolenv emulators fit --per-step`: {drift}"
    return Profile(
        tool=report.tool,
        model=model,
        response_tokens=response_tokens,
        reference=reference,
        source=source,
        notes=notes,
        fit=summary,
    )
