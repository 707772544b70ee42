"""Every service's settings class by config-file section: the one place that knows them all, so
the one that refuses a section no service reads (`sandboxx:` was silently nothing), and that
gives one service's setting to another that must agree with it (`with_sandbox_defaults`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
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


def with_sandbox_defaults(
    settings: GatewaySettings, sections: Mapping[str, Any]
) -> GatewaySettings:
    """Each built-in embedded sandbox tool that sets no default timeouts of its own takes the
    sandbox section's: a request that sent none was bounded by SandboxFusion's 10 s each, and a
    run the sandbox (`default_run_timeout_s: 30`) let run 30 s was cut at 25 s as the deadline's."""
    mode = settings.mode
    embedded = [
        i
        for i, tool in enumerate(settings.tools)
        if tool.kind == "sandbox" and tool.app is None and (mode or tool.mode) == "embedded"
    ]
    if not embedded:
        return settings
    sandbox = SandboxSettings.from_sections(sections)
    fields = ("default_compile_timeout_s", "default_run_timeout_s")
    tools = list(settings.tools)
    for i in embedded:
        unset = {f: getattr(sandbox, f) for f in fields if f not in tools[i].model_fields_set}
        tools[i] = tools[i].model_copy(update=unset)
    return settings.model_copy(update={"tools": tools})
