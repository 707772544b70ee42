"""Workloads: what each trajectory must do (PolyTrace replay, intern_s1 synthetic, live)."""

from .plan import TokenSynth, ToolCallPlan, TrajectoryPlan, TurnPlan
from .replay import LengthScale, replay_plans
from .synthetic import synthetic_plans

__all__ = [
    "LengthScale",
    "TokenSynth",
    "ToolCallPlan",
    "TrajectoryPlan",
    "TurnPlan",
    "replay_plans",
    "synthetic_plans",
]
