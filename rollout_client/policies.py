"""Rollout policies: small strategy objects that decide who waits for whom and when a step closes.

A policy sees trajectories and events (turn done, tool done, tool timed out, trajectory done),
never engines or HTTP. Policies combine (`"async+timeout"`, `"sync+timeout+overlap"`): each part
answers the questions it cares about and `PolicySet` merges the answers.

- `sync`: turn-synchronous (Search-R1 style): before every turn after the first, a trajectory
  waits until every live trajectory of the step has finished its previous turn and tool calls.
- `async`: trajectory-level: each trajectory proceeds on its own (the default).
- `timeout`: a per-tool-call deadline; at expiry the trajectory goes on with a timeout observation.
- `hedge`: the gateway's hedging of idempotent tools (a second attempt after a latency quantile
  of recent calls; the first answer that is not a 5xx or 429 wins). A live gateway hedges per its own tool settings; in
  virtual time this part turns the simulated gateway's hedging on.
- `overlap`: APRIL-style over-sampling: launch ceil(N * (1 + over)) trajectories, close the step
  when N are done; the rest carry over to the next step as partial rollouts (their staleness is
  recorded) or are aborted (their tokens are wasted), as configured.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

Unfinished = Literal["carry", "abort"]


@dataclass(frozen=True, slots=True)
class Event:
    kind: Literal["turn_done", "tool_done", "tool_timeout", "tool_error", "trajectory_done"]
    trajectory_id: str
    turn: int
    at: float


class TrajectoryView(Protocol):
    trajectory_id: str
    next_turn: int


class TurnBarrier:
    """A reusable phaser: every registered party arrives; the last arrival releases them all.

    Parties leave when their trajectory ends (or is cancelled), which may release the others.
    """

    def __init__(self) -> None:
        self.parties = 0
        self.arrived = 0
        self._release = asyncio.Event()

    def join(self) -> None:
        self.parties += 1

    def leave(self) -> None:
        self.parties -= 1
        self._maybe_release()

    def _maybe_release(self) -> None:
        if self.arrived and self.arrived >= self.parties:
            self.arrived = 0
            self._release.set()
            self._release = asyncio.Event()

    async def wait(self) -> None:
        release = self._release
        self.arrived += 1
        self._maybe_release()
        if release.is_set():
            return
        try:
            await release.wait()
        except asyncio.CancelledError:
            if not release.is_set():
                self.arrived -= 1
            raise


class Policy:
    """Defaults: no barrier, no deadline, launch N and close when all are done."""

    name = "base"

    def launch_count(self, target: int) -> int:
        return target

    def close_when_done(self, target: int) -> int:
        """How many finished trajectories close the step (the rest is unfinished)."""
        return math.inf  # type: ignore[return-value]

    def unfinished(self) -> Unfinished | None:
        return None

    def tool_deadline_s(self) -> float | None:
        return None

    def hedge_quantile(self) -> float | None:
        """Hedge idempotent tool calls after this quantile of their recent latency (None: never)."""
        return None

    def begin_step(self, step: int) -> None:
        """A step starts."""

    def join(self, trajectory: TrajectoryView) -> None:
        """A trajectory starts (or resumes) within the step."""

    def leave(self, trajectory: TrajectoryView) -> None:
        """A trajectory ended, was carried over or aborted."""

    async def before_turn(self, trajectory: TrajectoryView, turn: int) -> None:
        """Awaited before each turn's generation."""

    def on_event(self, event: Event) -> None:
        """Turn done, tool done / timed out / errored, trajectory done."""


class AsyncPolicy(Policy):
    name = "async"


class SyncPolicy(Policy):
    name = "sync"

    def __init__(self) -> None:
        self._barrier = TurnBarrier()

    def begin_step(self, step: int) -> None:
        self._barrier = TurnBarrier()

    def join(self, trajectory: TrajectoryView) -> None:
        self._barrier.join()

    def leave(self, trajectory: TrajectoryView) -> None:
        self._barrier.leave()

    async def before_turn(self, trajectory: TrajectoryView, turn: int) -> None:
        if turn > 0:
            await self._barrier.wait()


@dataclass
class TimeoutPolicy(Policy):
    seconds: float = 1.0
    name: str = "timeout"
    truncated: int = 0

    def __post_init__(self) -> None:
        if self.seconds <= 0:
            raise ValueError("the tool timeout must be > 0 seconds")

    def tool_deadline_s(self) -> float | None:
        return self.seconds

    def on_event(self, event: Event) -> None:
        if event.kind == "tool_timeout":
            self.truncated += 1


@dataclass
class HedgePolicy(Policy):
    quantile: float = 0.95
    name: str = "hedge"

    def __post_init__(self) -> None:
        if not 0 < self.quantile < 1:
            raise ValueError("the hedge quantile must be in (0, 1)")

    def hedge_quantile(self) -> float | None:
        return self.quantile


@dataclass
class OverlapPolicy(Policy):
    over: float = 0.25
    mode: Unfinished = "carry"
    name: str = "overlap"

    def __post_init__(self) -> None:
        if self.over <= 0:
            raise ValueError("overlap needs an over-sampling ratio > 0 (N' = N * (1 + over))")
        if self.mode not in ("carry", "abort"):
            raise ValueError("overlap mode must be 'carry' or 'abort'")

    def launch_count(self, target: int) -> int:
        """N * (1 + over) rounded up, to the nearest 1e-6 first: 100 * 1.1 is 110.00000000000001
        in floating point, and 111 were launched."""
        return math.ceil(round(target * (1 + self.over), 6))

    def close_when_done(self, target: int) -> int:
        return target

    def unfinished(self) -> Unfinished | None:
        return self.mode


@dataclass
class PolicySet(Policy):
    parts: list[Policy] = field(default_factory=list)

    @property
    def name(self) -> str:  # type: ignore[override]
        return "+".join(p.name for p in self.parts)

    def launch_count(self, target: int) -> int:
        return max(p.launch_count(target) for p in self.parts)

    def close_when_done(self, target: int) -> int:
        return min(p.close_when_done(target) for p in self.parts)

    def unfinished(self) -> Unfinished | None:
        modes = [m for p in self.parts if (m := p.unfinished()) is not None]
        return modes[0] if modes else None

    def tool_deadline_s(self) -> float | None:
        values = [s for p in self.parts if (s := p.tool_deadline_s()) is not None]
        return min(values) if values else None

    def hedge_quantile(self) -> float | None:
        values = [q for p in self.parts if (q := p.hedge_quantile()) is not None]
        return min(values) if values else None

    def begin_step(self, step: int) -> None:
        for p in self.parts:
            p.begin_step(step)

    def join(self, trajectory: TrajectoryView) -> None:
        for p in self.parts:
            p.join(trajectory)

    def leave(self, trajectory: TrajectoryView) -> None:
        for p in self.parts:
            p.leave(trajectory)

    async def before_turn(self, trajectory: TrajectoryView, turn: int) -> None:
        for p in self.parts:
            await p.before_turn(trajectory, turn)

    def on_event(self, event: Event) -> None:
        for p in self.parts:
            p.on_event(event)


POLICY_NAMES = ("sync", "async", "timeout", "hedge", "overlap")


def build_policy(
    spec: str,
    *,
    tool_timeout_s: float = 1.0,
    over: float = 0.25,
    unfinished: Unfinished = "carry",
    hedge_quantile: float = 0.95,
) -> PolicySet:
    """`"async+timeout"` -> a PolicySet of those parts. `sync` and `async` exclude each other."""
    names = [n.strip() for n in spec.split("+") if n.strip()]
    unknown = [n for n in names if n not in POLICY_NAMES]
    if not names or unknown:
        raise ValueError(
            f"unknown policy {'+'.join(unknown) or spec!r}; combine {', '.join(POLICY_NAMES)} with '+'"
        )
    if "sync" in names and "async" in names:
        raise ValueError("sync and async exclude each other")
    if len(set(names)) != len(names):
        raise ValueError(f"policy {spec!r} names a part twice")
    parts: list[Policy] = []
    for n in names:
        if n == "sync":
            parts.append(SyncPolicy())
        elif n == "async":
            parts.append(AsyncPolicy())
        elif n == "timeout":
            parts.append(TimeoutPolicy(tool_timeout_s))
        elif n == "hedge":
            parts.append(HedgePolicy(hedge_quantile))
        else:
            parts.append(OverlapPolicy(over, unfinished))
    if "sync" not in names and "async" not in names:
        parts.insert(0, AsyncPolicy())
    return PolicySet(parts)
