"""Emulator service settings."""

from __future__ import annotations

from typing import ClassVar

from pydantic_settings import SettingsConfigDict

from toolenv.config import ServiceSettings


class EmulatorSettings(ServiceSettings):
    model_config = SettingsConfigDict(
        env_prefix="TOOLENV_EMULATORS_", extra="ignore", env_nested_delimiter="__"
    )
    section: ClassVar[str] = "emulators"

    seed: int = 0
