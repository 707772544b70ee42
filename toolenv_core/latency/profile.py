"""A latency profile: the object a fit writes, a config file names and `PUT .../profile` takes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from toolenv_core.fields import Number

from ..config import parse_error
from ..errors import first_problem
from ..outputs import write_whole
from ..polytrace.kinds import CAPTURE, CAPTURE_KEYS, describe, kind_of_file, kind_of_record
from .specs import Drift, Faulty, LatencyModel, Mixture, TraceReplay


class ProfileError(ValueError):
    """A profile file that cannot be read or does not validate; names the file and the field."""


class Profile(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    tool: str = Field(default="search", description="the tool this profile shapes")
    model: LatencyModel = Field(description="latency per call")
    response_tokens: LatencyModel | None = Field(
        default=None,
        description="search: tokens returned per query for topk=3 (sampled like a latency)",
    )
    reference: dict[str, Annotated[Number, Field(gt=0)]] = Field(
        default_factory=dict,
        description="what the recorded calls looked like (e.g. reward batch_size), for scaling: "
        "each a divisor of a call's scale, so positive",
    )
    source: str | None = Field(default=None, description="where the numbers come from")
    notes: str | None = None
    fit: dict[str, Any] | None = Field(
        default=None, description="the fit report that chose the model"
    )

    @field_validator("response_tokens")
    @classmethod
    def _drawn_per_query(cls, value: Any) -> Any:
        """A size is drawn per (seed, query), from a sampler made for that query: a model that
        replays or drifts in call order gave every query its first value (a `trace` of sizes
        answered its first size to every query), and a fault has no meaning for a size."""
        kind = _order_bound_kind(value)
        if kind is not None:
            raise ValueError(
                f"a {kind!r} model cannot size responses: each query's size is drawn on its own "
                "(the same seed and query give the same size), never in call order or with "
                "faults; give its sizes as an 'empirical' model (samples or quantiles)"
            )
        return value

    def to_yaml(self) -> str:
        return yaml.safe_dump(
            self.model_dump(mode="json", exclude_none=True),
            sort_keys=False,
            width=120,
            default_flow_style=None,
        )


LATENCY_MODEL = TypeAdapter(LatencyModel)


def _order_bound_kind(model: Any) -> str | None:
    """The kind of the first model in `model` (itself, a mixture's components) that depends on
    call order or carries faults: `trace`, `drift` or `faulty`; None when there is none."""
    if isinstance(model, TraceReplay | Drift | Faulty):
        return model.kind
    if isinstance(model, Mixture):
        for component in model.components:
            kind = _order_bound_kind(component.model)
            if kind is not None:
                return kind
    return None


def parse_profile(data: Any, where: str = "profile") -> Profile:
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        field, msg = first_problem(exc)
        raise ProfileError(f"{where}: field {field!r}: {msg}") from exc


SHIPPED_DIR = Path(__file__).resolve().parent / "profiles"
SHIPPED = ("search_default", "reward_default")  # fitted from PolyTrace (docs/emulators.md)


def shipped_profile_path(name: str) -> Path:
    """A profile shipped with the package, by name (`search_default`, `reward_default`)."""
    return SHIPPED_DIR / f"{name}.yaml"


def load_profile(path: str | Path) -> Profile:
    """Read a YAML or JSON profile file, or a shipped profile by name (`search_default`) where
    no such file exists: installed from a wheel, a user has no source checkout to name one in."""
    p = Path(path)
    if str(path) in SHIPPED and not p.exists():
        p = shipped_profile_path(str(path))
    try:
        text = p.read_text()
    except OSError as exc:
        raise ProfileError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise _trace_given(p) or ProfileError(f"{p}: does not parse: {parse_error(exc)}") from exc
    if data is None:
        raise ProfileError(f"{p}: is empty (a profile needs at least `model:`)")
    if not isinstance(data, dict) or "model" not in data:
        capture = isinstance(data, dict) and CAPTURE_KEYS <= data.keys()
        kind = CAPTURE if capture else kind_of_record(data)
        if kind is not None:
            raise ProfileError(f"{p}: not a latency profile: it looks like {describe(kind)}")
    if not isinstance(data, dict):  # it said "field '': ... a valid dictionary or instance of"
        held = "a list" if isinstance(data, list) else "a single value"
        raise ProfileError(f"{p}: holds {held}, not a profile (a mapping with at least `model:`)")
    return parse_profile(data, str(p))


def _trace_given(p: Path) -> ProfileError | None:
    """A PolyTrace file or a gateway capture given for a profile (`--profile`, `emulators
    describe`): it said "does not parse: expected '<document start>'", YAML's words for JSONL.
    A file whose first line is a lone `{` is a broken JSON profile as likely as fitted
    parameters: its own error stands."""
    kind = kind_of_file(p)
    if kind in ("unknown", "fitted_parameters"):
        return None
    return ProfileError(f"{p}: not a latency profile: it looks like {describe(kind)}")


def save_profile(profile: Profile, path: str | Path) -> Path:
    """Write the profile whole or not at all (`write_whole`): a write that failed (a full disk)
    left the profile that was there cut short, no longer parsing."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix == ".json":
        text = profile.model_dump_json(indent=2, exclude_none=True) + "\n"
    else:
        text = profile.to_yaml()
    write_whole(p, text)
    return p
