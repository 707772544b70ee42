"""Every service's settings class by config-file section: the one place that knows them all, so
the one that refuses a section no service reads (`sandboxx:` was silently nothing)."""

from __future__ import annotations

import os
from typing import Any

from emulators.settings import EmulatorSettings
from gateway.settings import GatewaySettings
from rollout_client.settings import RolloutSettings
from sandboxd.settings import SandboxSettings
from toolenv_core.config import (
    ServiceSettings,
    check_section_keys,
    check_sections,
    read_sections,
    section_of,
)
from toolenv_core.polytrace.cache import TracesSettings

from .ray_settings import RaySettings

SETTINGS_CLASSES: dict[str, type[ServiceSettings]] = {
    cls.section: cls
    for cls in (
        GatewaySettings,
        SandboxSettings,
        EmulatorSettings,
        RolloutSettings,
        TracesSettings,
        RaySettings,
    )
}


def read_all_sections(config_file: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The config file's sections (`read_sections`), each the section of a known service (else a
    `ConfigFileError` naming the known ones and the closest) holding only that service's settings
    (else a `ValidationError` naming the key), whether or not this command builds the service."""
    sections = read_sections(config_file)
    check_sections(sections, SETTINGS_CLASSES)
    for name in sections:
        check_section_keys(SETTINGS_CLASSES[name], section_of(sections, name))
    return sections
