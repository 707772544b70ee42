"""Sandbox service settings."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic_settings import SettingsConfigDict

from toolenv.config import ServiceSettings


class SandboxSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="TOOLENV_SANDBOX_", extra="ignore", env_nested_delimiter="__")
    section: ClassVar[str] = "sandbox"

    backend: Literal["process", "docker"] = "process"
