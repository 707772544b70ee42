"""What a profile looks like: quantiles from a seeded sample, optionally against recorded data."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import scipy

from toolenv_core.latency.faults import ErrorFault
from toolenv_core.latency.profile import Profile
from toolenv_core.latency.specs import Drift, Faulty, Mixture
from toolenv_core.plotting import pyplot

from .fit import REPORT_QUANTILES, qname


def sample_profile(profile: Profile, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return profile.model.build().sample_many(rng, n)


def summarize(samples: np.ndarray) -> dict[str, float]:
    """Quantiles, mean and max. A quantile between two infinite draws (past the float range: a
    wide lognormal, a Pareto tail) is inf: numpy's interpolation made it nan (inf - inf), with
    its RuntimeWarning on stderr."""
    ps = (0.1, *REPORT_QUANTILES)
    with np.errstate(invalid="ignore"):
        qs = np.quantile(samples, ps)
    qs = np.where(np.isnan(qs), np.inf, qs)
    out = {qname(p): float(q) for p, q in zip(ps, qs, strict=True)}
    out.update(mean=float(samples.mean()), max=float(samples.max()))
    return out


def json_ready(value: Any) -> Any:
    """`value` with every infinite number as None: `--json` printed `Infinity`, which is not
    JSON (jq and strict parsers refuse the whole report)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_ready(v) for v in value]
    return value


def describe(
    profile: Profile, data: np.ndarray | None, n: int = 100_000, seed: int = 0
) -> dict[str, Any]:
    samples = sample_profile(profile, n, seed)
    report: dict[str, Any] = {
        "tool": profile.tool,
        "kind": profile.model.kind,
        "source": profile.source,
        "samples": n,
        "seed": seed,
        "model": summarize(samples),
    }
    faults = list(_faults(profile.model, None))  # what `fit` carries over, and hand-written ones
    if faults:
        report["faults"] = faults
    drift = profile.model.model if isinstance(profile.model, Faulty) else profile.model
    if isinstance(drift, Drift):  # one sample of a drift is mostly its first stage (by time,
        # or by step without calls_per_step: all of it): each stage is described on its own
        report["stages"] = [
            {"start": stage.start, "by": drift.by}
            | summarize(stage.model.build().sample_many(np.random.default_rng(seed), n))
            for stage in drift.schedule
        ]
    if profile.response_tokens is not None:
        tokens = profile.response_tokens.build().sample_many(np.random.default_rng(seed), 10_000)
        report["response_tokens_per_query"] = {
            "mean": float(tokens.mean()),
            "p50": float(np.median(tokens)),
        }
    if data is not None:
        report["data"] = summarize(data)
        report["data"]["n"] = int(data.size)
        report["ks_model_vs_data"] = float(scipy.stats.ks_2samp(samples, data).statistic)
        report["relative_error"] = {
            k: (report["model"][k] - v) / v if v else 0.0
            for k, v in report["data"].items()
            if k.startswith("p")
        }
    return report


def _faults(model: Any, where: str | None) -> Iterator[dict[str, Any]]:
    """Every fault in `model` with its rate as the profile gives it; `where` names the part of
    the model whose calls that rate is of (None: all calls). Only a top-level `faulty` model's
    were reported: a drift stage's 50% of errors went unsaid."""
    if isinstance(model, Faulty):
        for f in model.faults:
            yield (
                {"type": f.type, "rate": f.rate}
                | ({"status": f.status} if isinstance(f, ErrorFault) else {})
                | ({"where": where} if where else {})
            )
        # a fault drawn here replaces one drawn inside: the inner rates are of the calls left
        # (an inner 50% of errors under a 50% of hangs was "error on 50% of calls": 25% were)
        inner = where
        if model.faults:
            spared = 1.0 - sum(f.rate for f in model.faults)
            inner = _within(where, f"the calls the outer faults spare ({spared * 100:.4g}%)")
        yield from _faults(model.model, inner)
    elif isinstance(model, Drift):
        for stage in model.schedule:
            start = stage_label({"start": stage.start, "by": model.by}).removesuffix(" (s)")
            yield from _faults(stage.model, _within(where, f"the drift stage {start}"))
    elif isinstance(model, Mixture):
        total = sum(c.weight for c in model.components)
        for i, c in enumerate(model.components, start=1):
            part = f"mixture component {i} (weight {c.weight / total:.3g})"
            yield from _faults(c.model, _within(where, part))


def _within(outer: str | None, inner: str) -> str:
    return inner if outer is None else f"{outer}, {inner}"


def stage_label(stage: dict[str, Any]) -> str:
    """`from step 2 (s)` / `from 30 s (s)`: a drift stage's row in the human report."""
    start = f"step {stage['start']:g}" if stage["by"] == "step" else f"{stage['start']:g} s"
    return f"from {start} (s)"


def faults_line(faults: list[dict[str, Any]]) -> str:
    """`faults: error (HTTP 503) on 5.556% of calls, hang on 11.11%`, for the human report; a
    fault within a part of the model says whose calls: `; in the drift stage from step 0: ...`."""
    groups: dict[str | None, list[str]] = {}
    for f in faults:
        groups.setdefault(f.get("where"), []).append(
            f"{f['type']}"
            + (f" (HTTP {f['status']})" if "status" in f else "")
            + f" on {f['rate'] * 100:.4g}%"
        )
    said = []
    for where, parts in groups.items():
        calls = " of calls" if where is None else " of its calls"
        said.append(("" if where is None else f"in {where}: ") + parts[0] + calls)
        said[-1] += "".join(", " + p for p in parts[1:])
    return "faults: " + "; ".join(said)


def plot_cdf(
    profile: Profile, data: np.ndarray | None, out: Path, n: int = 100_000, seed: int = 0
) -> Path:
    """PNG of the model's CDF (log time axis) over the recorded data's empirical CDF."""
    plt = pyplot()

    samples = np.sort(sample_profile(profile, n, seed))
    levels = np.arange(1, samples.size + 1) / samples.size
    drawn = np.isfinite(samples)  # infinite draws have no place on the axis (nor its overflow)
    samples, levels = samples[drawn], levels[drawn]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    ax.plot(samples, levels, label=f"profile ({profile.model.kind}, n={n})")
    if data is not None:
        # a step CDF from 0: `step` through the points drew nothing for a one-call trace
        ax.ecdf(data, label=f"trace (n={data.size})", alpha=0.8)
    positive = samples[samples > 0]
    if positive.size and positive.max() / max(positive.min(), 1e-9) > 50:
        ax.set_xscale("log")
    ax.set_xlabel(f"{profile.tool} latency (s)")
    ax.set_ylabel("P(latency <= x)")
    ax.set_title(
        f"{profile.tool} latency: profile ({profile.model.kind})"
        + (" vs recorded trace" if data is not None else "")
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.savefig(out, format="png")  # exactly `out`: without a suffix matplotlib adds `.png`
    finally:
        plt.close(fig)
    return out
