"""The intern_s1 fitted-parameters JSON (`enhanced_task_distribution_parameters.json`).

A single JSON document (not JSONL): distributions fitted to a 235B deployment's math and
tool-calling sessions. A malformed document raises `TraceFormatError` naming the line where the
offending field sits (found by searching for its key) and the field's dotted path.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import scipy  # its submodules load on first use: scipy.stats costs about 0.9 s
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from ..errors import first_problem
from .errors import TraceFormatError
from .jsonl import not_an_object, not_json, not_text, open_trace
from .kinds import kind_error


class _Doc(BaseModel):
    # NaN or inf in a mean or a covariance failed later, far from the file ("cannot convert float
    # NaN to integer")
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class FittedDistribution(_Doc):
    """A scipy.stats distribution by name with its fitted parameters (shape(s), loc, scale)."""

    type: str
    parameters: list[float]
    ks_statistic: float | None = None
    ks_p_value: float | None = None

    def frozen(self) -> Any:
        """The scipy frozen distribution these parameters describe."""
        dist = getattr(scipy.stats, self.type, None)
        if dist is None:
            raise ValueError(f"scipy.stats has no distribution named {self.type!r}")
        return dist(*self.parameters)


class JointDistribution(_Doc):
    type: str
    n_components: int = Field(ge=1)
    mean_vector: list[float]
    covariance_matrix: list[list[float]]
    correlation: float | None = None
    bic_score: float | None = None


class GmmParameters(_Doc):
    weights: list[float]
    means: list[list[float]]
    covariances: list[list[list[float]]]

    @field_validator("means", "covariances")
    @classmethod
    def _one_per_component(cls, value: list, info: ValidationInfo) -> list:
        weights = info.data.get("weights")
        if weights is not None and len(value) != len(weights):
            raise ValueError(f"has {len(value)} components but weights has {len(weights)}")
        return value

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Draw n joint samples (one row each) from the mixture."""
        w = np.asarray(self.weights, dtype=float)
        comp = rng.choice(len(w), size=n, p=w / w.sum())
        means = np.asarray(self.means)
        covs = np.asarray(self.covariances)
        out = np.empty((n, means.shape[1]))
        for k in range(len(w)):
            idx = np.flatnonzero(comp == k)
            if idx.size:
                out[idx] = rng.multivariate_normal(means[k], covs[k], size=idx.size)
        return out


class MathTask(_Doc):
    task_type: str
    input_distribution: FittedDistribution
    output_distribution: FittedDistribution
    joint_distribution: JointDistribution | None = None
    gmm_parameters: GmmParameters | None = None


class SequenceModel(_Doc):
    """Per call count: a Gaussian over per-call input/output lengths and session aggregates."""

    call_count: int = Field(ge=1)
    n_features: int = Field(ge=1)
    feature_names: list[str]
    model_type: str
    optimal_components: int | None = None
    mean_vector: list[float]
    covariance_matrix: list[list[float]]

    @field_validator("feature_names", "mean_vector", "covariance_matrix")
    @classmethod
    def _one_per_feature(cls, value: list, info: ValidationInfo) -> list:
        n = info.data.get("n_features")
        if n is not None and len(value) != n:
            raise ValueError(f"has {len(value)} entries but n_features is {n}")
        return value

    @field_validator("feature_names")
    @classmethod
    def _per_call_lengths(cls, value: list[str], info: ValidationInfo) -> list[str]:
        """The lengths a synthetic trajectory is drawn from: input_i and output_i of each call."""
        k = info.data.get("call_count") or 0
        missing = [f"{kind}_{i}" for i in range(1, k + 1) for kind in ("input", "output")]
        missing = [name for name in missing if name not in value]
        if missing:
            raise ValueError(f"lacks {', '.join(missing)} for {k} calls")
        return value


class ToolCallingTask(_Doc):
    task_type: str
    call_count_distribution: dict[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=0)]]
    sequence_models: dict[int, SequenceModel] = Field(default_factory=dict)
    total_sessions: int | None = None

    @field_validator("call_count_distribution")
    @classmethod
    def _some_sessions(cls, value: dict[int, int]) -> dict[int, int]:
        if sum(value.values()) <= 0:  # it was a ZeroDivisionError, or numpy's "a cannot be empty"
            raise ValueError("counts no sessions: at least one call count needs a count above 0")
        return value

    @field_validator("sequence_models")
    @classmethod
    def _one_per_call_count(
        cls, value: dict[int, SequenceModel], info: ValidationInfo
    ) -> dict[int, SequenceModel]:
        counts = info.data.get("call_count_distribution") or {}
        missing = sorted(k for k, n in counts.items() if n > 0 and k not in value)
        if missing:  # a draw of that count was a KeyError
            raise ValueError(f"has no model for {', '.join(map(str, missing))} calls")
        return value

    def call_count_probabilities(self) -> dict[int, float]:
        total = sum(self.call_count_distribution.values())
        return {k: v / total for k, v in sorted(self.call_count_distribution.items())}


class FittedParameters(_Doc):
    version: str
    extraction_info: dict[str, Any] = Field(default_factory=dict)
    math_task: MathTask
    tool_calling_task: ToolCallingTask
    correlation_analysis: dict[str, Any] | None = None
    quality_metrics: dict[str, Any] | None = None


def _line_of(text: str, dotted: str) -> int:
    """Best effort: the line holding the last key of a dotted path (1 when it cannot be found)."""
    keys = [k for k in dotted.split(".") if k and not k.isdigit()]
    pos = 0
    for key in keys:
        found = text.find(f'"{key}"', pos)
        if found < 0:
            break
        pos = found
    return text.count("\n", 0, pos) + 1


def read_fitted_parameters(path: str | Path) -> FittedParameters:
    """Read and validate the fitted-parameters document."""
    p = Path(path)
    with open_trace(p) as handle:
        try:
            text = handle.read()
        except UnicodeDecodeError as exc:
            raise not_text(p, 1, exc) from exc
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise kind_error(p, "fitted_parameters") or TraceFormatError(
            p, exc.lineno, "", not_json(exc)
        ) from exc
    if not isinstance(raw, dict):
        raise TraceFormatError(p, 1, "", not_an_object(raw))
    try:
        return FittedParameters.model_validate(raw)
    except ValidationError as exc:
        field, msg = first_problem(exc)
        raise kind_error(p, "fitted_parameters") or TraceFormatError(
            p, _line_of(text, field), field, msg
        ) from exc
