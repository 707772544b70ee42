"""The latency profiles shipped with the emulators (`emulators/profiles/<name>.yaml`)."""

from __future__ import annotations

from pathlib import Path

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


def packaged_profile_path(name: str) -> Path:
    """A profile shipped with the package, by name (`search_default`, `reward_default`)."""
    return PROFILES_DIR / f"{name}.yaml"
