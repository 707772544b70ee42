"""Emulator service settings (`emulators:` section, env prefix `TOOLENV_EMULATORS_`)."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import ClassVar

from pydantic import DirectoryPath, Field, FilePath, model_validator
from pydantic_settings import SettingsConfigDict

from toolenv_core.config import FrontDoorSettings, LogLevel
from toolenv_core.deadline import DeadlinePolicy
from toolenv_core.fields import Integer, Number
from toolenv_core.latency.profile import Profile
from toolenv_core.polytrace.cache import TracesSettings


class EmulatorSettings(FrontDoorSettings):
    model_config = SettingsConfigDict(
        env_prefix="TOOLENV_EMULATORS_", extra="ignore", env_nested_delimiter="__"
    )
    section: ClassVar[str] = "emulators"

    host: str = "127.0.0.1"
    port: Integer = Field(default=8090, ge=0, le=65535)
    log_level: LogLevel = "warning"
    seed: Integer = Field(
        default=0, ge=0, description="seeds every delay draw and every synthetic document"
    )

    search_profile: Profile | None = Field(default=None, description="inline search profile")
    search_profile_file: Path | None = Field(
        default=None, description="search profile file (default: the shipped search_default.yaml)"
    )
    reward_profile: Profile | None = Field(default=None, description="inline reward profile")
    reward_profile_file: Path | None = Field(
        default=None, description="reward profile file (default: the shipped reward_default.yaml)"
    )

    trace_dirs: list[DirectoryPath] = Field(  # a typo's directory was silently of no use
        default_factory=list,
        description="directories besides the trace cache whose traces a profile PUT over HTTP "
        "may replay (`trace` paths); profiles in the config file may name any path",
    )
    corpus: FilePath | None = Field(
        default=None, description="JSONL corpus ({id, contents} or {id, title, text}) for BM25"
    )
    default_topk: Integer = Field(default=3, ge=1)
    max_topk: Integer = Field(default=50, ge=1)
    max_queries: Integer = Field(default=256, ge=1, description="queries per request")
    max_query_chars: Integer = Field(default=4096, ge=1)
    max_delay_s: Number = Field(
        default=3600.0,
        gt=0,
        description="the longest a call sleeps: a larger delay_s is a 422; a drawn delay, a slow "
        "body's trickle and a hang without deadline are capped at it (never a hang)",
    )
    max_response_tokens: Integer = Field(
        default=200_000,
        ge=1,
        description="the most a call's response_tokens may ask for, and a profile may draw for "
        "one query",
    )
    document_cache_size: Integer = Field(
        default=8192, ge=0, description="queries whose documents are kept (0: none)"
    )
    document_cache_mb: Number = Field(
        default=256, ge=0, description="the most the kept documents may take, in MiB (0: none)"
    )

    max_pacing_lead_s: Number = Field(
        default=0.002,
        ge=0,
        le=0.05,
        description="how early a handler may wake to cover the response path it measured, so "
        "that replies leave on schedule (timing.Pacer); 0 turns pacing off",
    )
    hang_without_deadline_s: Number = Field(
        default=60.0,
        gt=0,
        description="how long a hang fault lasts when the caller sent no deadline",
    )
    default_deadline_s: Number | None = Field(
        default=None, gt=0, description="deadline when none is sent (None: no deadline)"
    )
    max_deadline_s: Number | None = Field(
        default=None, gt=0, description="clamp on the caller's deadline"
    )

    reward_length_exponent: Number = Field(
        default=0.0,
        description="reward delay scales with (mean response length / recorded mean) ** this",
    )

    @model_validator(mode="after")
    def _default_topk_within_max(self) -> EmulatorSettings:
        """A `default_topk` above `max_topk` was accepted: every `/retrieve` that sent no topk
        was a 422 naming a topk the caller never sent."""
        if self.default_topk > self.max_topk:
            raise ValueError(
                f"default_topk ({self.default_topk}) exceeds max_topk ({self.max_topk})"
            )
        return self

    @model_validator(mode="after")
    def _default_deadline_within_max(self) -> EmulatorSettings:
        """A `default_deadline_s` above `max_deadline_s` was cut to the cap without a word (the
        gateway refuses its `default_deadline_ms` above `max_deadline_ms`)."""
        default, cap = self.default_deadline_s, self.max_deadline_s
        if default is not None and cap is not None and default > cap:
            raise ValueError(f"default_deadline_s ({default}) exceeds max_deadline_s ({cap})")
        return self

    @cached_property
    def deadline_policy(self) -> DeadlinePolicy:
        """The one deadline rule (toolenv_core.deadline) with this service's default and cap."""
        return DeadlinePolicy(self.default_deadline_s, self.max_deadline_s)

    @cached_property
    def trace_cache(self) -> Path:
        """The trace cache of this service's config (its `traces.cache_dir`, else the
        `TOOLENV_TRACES_CACHE_DIR` variable or the default): where profile trace names are found."""
        return Path(self.beside(TracesSettings).cache_dir).expanduser()

    @cached_property
    def trace_roots(self) -> list[Path]:
        """Where a profile sent over HTTP may read traces: the trace cache, then `trace_dirs`."""
        return [self.trace_cache, *self.trace_dirs]
