"""The search emulator: Search-R1 `/retrieve` plus a native endpoint, delays from a latency profile."""

from .emulator import SearchEmulator
from .router import build_router

__all__ = ["SearchEmulator", "build_router"]
