"""Gateway settings: where it listens and how it guards the front door."""

from __future__ import annotations

from typing import ClassVar

from pydantic_settings import SettingsConfigDict

from toolenv.config import ServiceSettings


class GatewaySettings(ServiceSettings):
    model_config = SettingsConfigDict(env_prefix="TOOLENV_GATEWAY_", extra="ignore", env_nested_delimiter="__")
    section: ClassVar[str] = "gateway"

    host: str = "127.0.0.1"
    port: int = 8080
    log_level: str = "info"
