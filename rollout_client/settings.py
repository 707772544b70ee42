"""Rollout client settings."""

from __future__ import annotations

from typing import ClassVar

from pydantic_settings import SettingsConfigDict

from toolenv.config import ServiceSettings


class RolloutSettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="TOOLENV_ROLLOUT_", extra="ignore", env_nested_delimiter="__")
    section: ClassVar[str] = "rollout"

    gateway_url: str = "http://127.0.0.1:8080"
