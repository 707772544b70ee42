"""Configuration: one pydantic-settings object per service, from `TOOLENV_*` env vars and a file.

Precedence (highest first): explicit keyword arguments, environment variables, the config file
section, defaults. The config file is YAML, TOML or JSON, named by `TOOLENV_CONFIG` or passed
explicitly; each service reads its own top-level section (`gateway:`, `sandbox:`, ...). A key of
a section that names no setting is an error (a typo was silently a default); so is a section that
names no service, checked by whoever knows every service (`check_sections`, the `toolenv` CLI).
Environment variables that match no setting are left alone: shells carry stray ones.
Nothing here reads configuration at import time: services build their settings once at start-up.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar, get_args, get_origin

import yaml
from pydantic import (
    AliasChoices,
    AliasPath,
    BaseModel,
    BeforeValidator,
    Field,
    ValidationError,
)
from pydantic.fields import FieldInfo
from pydantic_core import InitErrorDetails, PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from toolenv_core.errors import problems
from toolenv_core.fields import Integer, Number

CONFIG_ENV_VAR = "TOOLENV_CONFIG"
# uvicorn's levels, in any case: one outside them was its KeyError or logging's ValueError at start
LogLevel = Annotated[
    Literal["critical", "error", "warning", "info", "debug", "trace"],
    BeforeValidator(lambda value: value.lower() if isinstance(value, str) else value),
]


class ConfigFileError(ValueError):
    """The config file is missing, unreadable or not a mapping of sections."""


class EnvValueError(ValueError):
    """An environment variable's JSON value does not parse: the message names the variable, where
    the JSON broke and what a valid value looks like."""


def config_error(exc: Exception) -> str:
    """One line saying what to fix: a settings `ValidationError` as `section: field: problem; ...`
    (pydantic's own text spans lines and ends in a URL), anything else as its message."""
    if isinstance(exc.__cause__, EnvValueError):  # pydantic-settings wraps it in its own words
        return str(exc.__cause__)
    if not isinstance(exc, ValidationError):
        return str(exc)
    classes = {cls.__name__: cls for cls in _subclasses(ServiceSettings)}
    settings_cls = classes.get(exc.title)
    pairs = problems(exc)
    if settings_cls is not None:  # a typo in a nested table: said as a section's typo is
        pairs = [
            (path, _unknown_key(settings_cls, error) or msg)
            for (path, msg), error in zip(pairs, exc.errors(), strict=True)
        ]
    said = "; ".join(": ".join(filter(None, pair)) for pair in pairs)
    section = settings_cls.section if settings_cls is not None else exc.title
    return f"invalid {section} settings: {said}"


def _unknown_key(settings_cls: type[BaseModel], error: Mapping[str, Any]) -> str | None:
    """`unknown setting (did you mean X?)` for a key of a nested table (a tools-table entry, its
    `retry:`) that names no setting: pydantic says "Extra inputs are not permitted"."""
    if error["type"] != "extra_forbidden" or not error["loc"]:
        return None
    model: type[BaseModel] | None = settings_cls
    for part in error["loc"][:-1]:
        if isinstance(part, int):
            continue  # an entry of a list: its model is the list's
        field = model.model_fields.get(part) if model is not None else None
        model = _model_in(field.annotation) if field is not None else None
    if model is None:
        return None
    return "unknown setting" + did_you_mean(str(error["loc"][-1]), _known_keys(model))


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model an annotation holds (`list[ToolConfig]`, `RetryPolicy | None` -> the model)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def parse_error(exc: Exception) -> str:
    """A YAML, TOML or JSON parse error on one line: PyYAML's own text spans lines, with a caret
    under a copy of the line and `<unicode string>` for the file's name."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"{exc.problem} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(exc).split())


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping: it kept the last, so a
    second `sandbox:` section dropped every setting of the first without a word."""


def _unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden
            continue
        key = loader.construct_object(key_node)
        if not isinstance(key, str | int | float | bool):
            continue  # an unhashable key: construct_mapping says so
        if key in seen:
            raise yaml.constructor.ConstructorError(
                problem=f"{key!r} is given twice (also on line {seen[key]}): merge them into one",
                problem_mark=key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused when it names a key twice (`json` kept the last, as PyYAML did)."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"{key!r} is given twice in one object: merge them into one")
        data[key] = value
    return data


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML/TOML/JSON config file into a mapping of sections."""
    p = Path(path)
    if p.is_dir():
        raise ConfigFileError(f"config file {p} is a directory: name a YAML, TOML or JSON file")
    if p.exists() and not p.is_file():  # a device or a FIFO: it said "does not exist"
        raise ConfigFileError(
            f"config file {p} is not a regular file: name a YAML, TOML or JSON file"
        )
    if not p.is_file():
        raise ConfigFileError(f"config file {p} does not exist")
    try:
        text = p.read_text(encoding="utf-8-sig")  # an editor's BOM: TOML and JSON refused it
    except UnicodeDecodeError as exc:
        raise ConfigFileError(
            f"config file {p} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset "
            f"{exc.start}): name a YAML, TOML or JSON file"
        ) from exc
    except OSError as exc:
        raise ConfigFileError(f"config file {p} cannot be read: {exc.strerror or exc}") from exc
    kind = {".toml": "TOML", ".json": "JSON"}.get(p.suffix.lower(), "YAML")  # `.TOML` was YAML
    try:
        if kind == "TOML":
            data = tomllib.loads(text)
        elif kind == "JSON":
            data = json.loads(text, object_pairs_hook=_unique_object)
        else:
            data = yaml.load(text, Loader=_UniqueKeyLoader) or {}  # a SafeLoader
    except (ValueError, yaml.YAMLError) as exc:
        raise ConfigFileError(
            f"config file {p} does not parse as {kind}: {parse_error(exc)}"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigFileError(
            f"config file {p} must hold a mapping of sections, got {type(data).__name__}"
        )
    return data


def did_you_mean(word: str, known: Collection[str]) -> str:
    """` (did you mean X?)` for the known word closest to a typo, or nothing when none is close."""
    close = difflib.get_close_matches(word, sorted(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def check_sections(sections: Mapping[str, Any], known: Collection[str]) -> None:
    """Refuse a top-level section that no service reads: `sandboxx:` was silently nothing.

    Only the caller that wires every service knows them all (toolenv_core imports none)."""
    unknown = [name for name in sections if name not in known]
    if unknown:
        said = ", ".join(f"{str(name)!r}{did_you_mean(str(name), known)}" for name in unknown)
        plural = "s" if len(unknown) > 1 else ""
        raise ConfigFileError(
            f"unknown config section{plural} {said}; known: {', '.join(sorted(known))}"
        )


def read_sections(config_file: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The config file's sections (the explicit file, else `TOOLENV_CONFIG`, else none), read once.

    What a process that builds several services reads, then hands to each settings class with
    `ServiceSettings.from_sections`, so the file is read one time for all of them.
    """
    path = config_file or os.environ.get(CONFIG_ENV_VAR)
    return read_config_file(path) if path else {}


def section_of(sections: Mapping[str, Any], section: str) -> dict[str, Any]:
    """One section's settings (empty if the file has none, or `section:` with nothing under it),
    refused unless it is a mapping: `sandbox: 0`, `false` or `[]` was an empty section."""
    values = sections.get(section)
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigFileError(f"config section {section!r} must be a mapping")
    return values


class _FileSectionSource(PydanticBaseSettingsSource):
    """One section of the config file's sections (already read), as a settings source."""

    def __init__(
        self, settings_cls: type[BaseSettings], sections: Mapping[str, Any], section: str
    ) -> None:
        super().__init__(settings_cls)
        self._values = section_of(sections, section)

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return self._values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        check_section_keys(self.settings_cls, self._values)
        return dict(self._values)


def check_section_keys(settings_cls: type[BaseModel], values: Mapping[str, Any]) -> None:
    """Refuse a key of a file section that names no setting, as a `ValidationError` naming it
    (one problem per key, with the closest setting), so it reads like any other bad value."""
    known = _known_keys(settings_cls)
    errors = [
        InitErrorDetails(
            type=PydanticCustomError(
                "unknown_setting", "unknown setting{hint}", {"hint": did_you_mean(str(key), known)}
            ),
            loc=(str(key),),
            input=value,
        )
        for key, value in values.items()
        if key not in known
    ]
    if errors:
        raise ValidationError.from_exception_data(settings_cls.__name__, errors)


def _known_keys(settings_cls: type[BaseModel]) -> set[str]:
    """The keys a file section may hold: each field's name and its aliases, if any."""
    known: set[str] = set()
    for name, field in settings_cls.model_fields.items():
        known.add(name)
        for alias in (field.alias, field.validation_alias):
            choices = alias.choices if isinstance(alias, AliasChoices) else [alias]
            for choice in choices:
                if isinstance(choice, AliasPath):
                    choice = choice.path[0]
                if isinstance(choice, str):
                    known.add(choice)
    return known


def _json_kind(annotation: Any) -> str:
    """What JSON value a field takes from an env var: a list or an object."""
    kinds = {"list" if get_origin(a) in (list, tuple, set) else "object" for a in _flat(annotation)}
    return "a JSON list" if kinds == {"list"} else "a JSON object"


def _flat(annotation: Any) -> list[Any]:
    """The complex members of an annotation (`X | None` -> [X])."""
    args = get_args(annotation) if get_origin(annotation) is not None else ()
    if args and get_origin(annotation) not in (list, tuple, set, dict):
        return [a for arg in args if arg is not type(None) for a in _flat(arg)]
    is_model = isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return [annotation] if is_model or get_origin(annotation) else []


class _EnvSource(EnvSettingsSource):
    """The `TOOLENV_<SECTION>_*` variables, as pydantic-settings reads them; a JSON value (a list
    or a table, such as `TOOLENV_GATEWAY_TOOLS`) that does not parse is an `EnvValueError`. The
    value is never echoed: it may hold a key."""

    def __call__(self) -> dict[str, Any]:
        self._refuse_list_entries()
        return super().__call__()

    def _refuse_list_entries(self) -> None:
        """`TOOLENV_GATEWAY_TOOLS__0__CONCURRENCY=5`: a list is set whole. It was "tools: Input
        should be a valid list" (no variable named), or ignored without a word beside
        `TOOLENV_GATEWAY_TOOLS`."""
        for field_name, field in self.settings_cls.model_fields.items():
            if _json_kind(field.annotation) != "a JSON list" or not _flat(field.annotation):
                continue
            for _, env_name, _ in self._extract_field_info(field, field_name):
                prefix = f"{env_name}{self.env_nested_delimiter}"
                for name, value in self.env_vars.items():
                    if name.startswith(prefix) and value:
                        whole = env_name.upper()
                        raise EnvValueError(
                            f"{name.upper()} cannot set one entry of {field_name} (a list): "
                            f"give the whole list as JSON in {whole}, or in the config file"
                        )

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        try:
            return super().decode_complex_value(field_name, field, value)
        except json.JSONDecodeError as exc:
            name = self._extract_field_info(field, field_name)[0][1].upper()
            where = f"line {exc.lineno} column {exc.colno}, char {exc.pos}"
            hint = f"send {_json_kind(field.annotation)}"
            if field.examples:
                hint += f", e.g. {json.dumps(field.examples[0])}"
            raise EnvValueError(f"{name} is not valid JSON ({exc.msg}: {where}); {hint}") from exc


_Settings = TypeVar("_Settings", bound="ServiceSettings")


class ServiceSettings(BaseSettings):
    """Base for every service's settings: env prefix `TOOLENV_<SECTION>_`, file section `<section>`."""

    # Every float setting is a finite amount: `inf` (or `nan`) would pass `gt=0` and then print
    # as `Infinity` in `config show --json` (not JSON). An empty variable (compose's `${VAR}` with
    # VAR unset) is no setting: a path was Path("") = ".". Subclasses' configs merge with this one.
    model_config = SettingsConfigDict(
        extra="ignore", env_nested_delimiter="__", allow_inf_nan=False, env_ignore_empty=True
    )
    section: ClassVar[str] = ""
    _config_path: ClassVar[str | None] = None
    _config_sections: ClassVar[Mapping[str, Any] | None] = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sections = cls._config_sections
        if sections is None:
            sections = read_sections(cls._config_path)
        return (
            init_settings,
            _EnvSource(settings_cls),  # the same variables, with a clear word on bad JSON
            _FileSectionSource(settings_cls, sections, cls.section),
        )

    @classmethod
    def load(cls, config_file: str | os.PathLike[str] | None = None, **overrides: Any):
        """Build the settings once, from an explicit file (else `TOOLENV_CONFIG`) and overrides."""
        path = str(config_file) if config_file else None
        if path is None:
            return cls(**overrides)
        # A subclass bound to this file: no mutation of the caller's class, no global state.
        bound = type(cls.__name__, (cls,), {"_config_path": path, "__module__": cls.__module__})
        return bound(**overrides)

    def beside(self, other: type[_Settings]) -> _Settings:
        """Another section's settings, read from the same source as these (the file `-c` named,
        or the sections already read): a service that reads a second section (the emulators'
        `traces.cache_dir`) read it from `TOOLENV_CONFIG` instead, whatever file it was given."""
        own = type(self)
        if own._config_sections is not None:
            return other.from_sections(own._config_sections)
        return other.load(own._config_path)

    @classmethod
    def from_sections(cls, sections: Mapping[str, Any], **overrides: Any):
        """Build the settings from a config file already read (`read_sections`): no second read."""
        bound = type(
            cls.__name__, (cls,), {"_config_sections": sections, "__module__": cls.__module__}
        )
        return bound(**overrides)


class FrontDoorSettings(ServiceSettings):
    """A service that answers HTTP itself: the two bounds on a request body
    (`toolenv_core.bodylimit`), defined once so that no front door refuses what the service
    behind it accepts."""

    max_body_bytes: Integer = Field(
        default=16 * 1024 * 1024,
        ge=1024,
        description="a larger request body is a 413 (refused before it is read when declared)",
    )
    body_timeout_s: Number = Field(
        default=10.0,
        gt=0,
        description="the whole request body must arrive within this; else 408 and the connection "
        "is closed",
    )
