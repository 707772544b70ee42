"""The code-verification (reward) latency emulator: sandbox time per batch, without running code."""

from .emulator import RewardEmulator
from .router import build_router

__all__ = ["RewardEmulator", "build_router"]
