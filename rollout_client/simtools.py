"""Tool calls answered in process, on the running loop's clock: the virtual-time gateway.

`SimTools` has the `GatewayClient` interface (`check`, `call`, `close`), so the runner cannot
tell it from the real gateway. A call's latency is the trace's recorded latency (`exact`: the
`delay_s` the replay puts in the arguments, as the search emulator would sleep it) or a draw from
the tool's latency profile, the very sampler the emulators build from the same profile file. A
call then plays out as the emulators and the gateway play it out:

- a fault drawn per call: `hang` answers nothing until the deadline (or `hang_s`), `error`
  answers an error after the delay, `throttle` answers 429 with Retry-After (retried while the
  deadline allows and never past the client's own timeout, as `GatewayClient` does), `slow_body`
  adds its trickle time;
- the deadline: past it the call is a timeout, at exactly the deadline;
- hedging (idempotent tools): a second attempt once the first has waited the quantile delay of
  `toolenv_core.hedging.LatencyWindow`, the gateway's own rule; the first answer wins unless it
  is a 5xx or 429 while the other attempt runs (then the other's, or the failure just before the
  deadline), and the call counts once (`stats.hedges` counts the duplicates sent).

Each call's randomness is seeded from the run seed and the call's identity, so a call draws the
same latency under every policy (common random numbers: policies differ by what they do, not
by luck). A call made again (its trajectory carried over after a step closed on it) is a new
attempt with draws of its own: a hang is a fault of one attempt, not of the query.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from toolenv_core.deadline import Deadline
from toolenv_core.hedging import (
    HELD_FAILURE_MARGIN_S,
    LatencyWindow,
    another_attempt_may_do_better,
)
from toolenv_core.latency import ErrorFault, Fault, HangFault, SlowBodyFault, ThrottleFault
from toolenv_core.latency.samplers import Draw, FaultySampler, Sampler

from .clock import now
from .gateway_client import CLIENT_TIMEOUT_S, ToolOutcome, backpressure_gave_up


@dataclass
class ToolModel:
    """How one tool answers: a latency sampler (None: exact recorded latencies only), scaled."""

    sampler: Sampler | None = None  # draws; with recorded latencies, for hedge attempts only
    scale: float = 1.0  # every delay is multiplied by this (slower tools: x10, x100)
    use_recorded: bool = True  # a call's recorded delay_s wins over the sampler
    faults: Sequence[Fault] = ()  # drawn on top of exact latencies (a sampler carries its own)
    idempotent: bool = True  # may be hedged


@dataclass
class ToolStats:
    calls: int = 0
    hedges: int = 0  # duplicate attempts sent by hedging
    timeouts: int = 0
    errors: int = 0
    throttled: int = 0
    faults: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Attempt:
    """One attempt's fate: when it would answer (inf: never) and with what."""

    after_s: float
    status: str  # ok | error | timeout | throttle
    retry_after_s: float = 0.0
    error: str | None = None
    http_status: int = 200  # the upstream's answer: an error fault's status, a throttle's 429

    @property
    def failed(self) -> bool:
        """An answer the gateway holds while a hedge still runs (`_race`)."""
        return self.status != "timeout" and another_attempt_may_do_better(self.http_status)


class SimTools:
    """The gateway, simulated: tool latency and faults in process, no HTTP, any clock."""

    def __init__(
        self,
        tools: dict[str, ToolModel],
        *,
        default: ToolModel | None = None,
        seed: int = 0,
        hedge: Callable[[], LatencyWindow] | None = None,
        hang_s: float = 60.0,
    ) -> None:
        self.tools = tools
        self.default = default  # for tools without a model of their own
        self.seed = seed
        self.hang_s = hang_s
        self.stats = ToolStats()
        self._hedge_factory = hedge
        self._windows: dict[str, LatencyWindow] = {}
        self._fault_draws: dict[str, FaultySampler] = {}
        self._attempts: dict[str, int] = {}  # calls made so far per call identity

    async def check(self) -> None:
        """Nothing to reach."""

    async def close(self) -> None:
        """Nothing to release."""

    def _model(self, tool: str) -> ToolModel:
        model = self.tools.get(tool, self.default)
        if model is None:
            raise ValueError(f"no latency model for tool {tool!r} (known: {sorted(self.tools)})")
        return model

    def _draw(
        self,
        tool: str,
        model: ToolModel,
        arguments: dict[str, Any],
        rng: np.random.Generator,
        step: int,
        hedge: bool = False,
    ) -> Draw:
        """A first attempt replays the recorded latency; a hedge draws a fresh one if it can.
        The step is the call's, as the emulators take it from `X-Step` (a drift by step)."""
        recorded = arguments.get("delay_s") if model.use_recorded else None
        if recorded is not None and not (hedge and model.sampler is not None):
            draw = Draw(float(recorded))
        elif model.sampler is not None:
            draw = model.sampler.draw(rng, step)
        else:
            raise ValueError(
                f"tool {tool!r} has no latency profile and the call carries no recorded delay_s "
                "(replay with --exact, or give --tool-profile)"
            )
        fault = draw.fault
        if model.faults and fault is None:
            if tool not in self._fault_draws:
                self._fault_draws[tool] = FaultySampler(_Zero(), model.faults)
            fault = self._fault_draws[tool].draw(rng).fault
        return Draw(draw.delay_s * model.scale, fault)

    def _attempt(self, draw: Draw) -> _Attempt:
        fault = draw.fault
        if isinstance(fault, ThrottleFault):
            retry_after_s = max(0.01, math.ceil(fault.retry_after_s))
            return _Attempt(0.0, "throttle", retry_after_s=retry_after_s, http_status=429)
        if isinstance(fault, HangFault):
            return _Attempt(math.inf, "timeout", error="no answer (injected hang fault)")
        if isinstance(fault, ErrorFault):
            error = f"HTTP {fault.status}: {fault.message}"
            return _Attempt(draw.delay_s, "error", error=error, http_status=fault.status)
        if isinstance(fault, SlowBodyFault):
            return _Attempt(draw.delay_s + fault.duration_s, "ok")
        return _Attempt(draw.delay_s, "ok")

    async def call(
        self,
        tool: str,
        arguments: dict[str, Any],
        *,
        deadline: Deadline | None = None,
        trajectory_id: str = "",
        step: int = 0,
        turn: int = 0,
    ) -> ToolOutcome:
        model = self._model(tool)
        key = f"{trajectory_id}/{turn}/{arguments.get('query') or arguments.get('queries')}"
        attempt = self._attempts.get(key, 0)
        self._attempts[key] = attempt + 1
        rng = np.random.default_rng(
            [self.seed, zlib.crc32(key.encode()), *([attempt] if attempt else [])]
        )
        started = now()
        limit = math.inf if deadline is None else deadline.at
        # Backpressure is waited out until the deadline, never past the client's own timeout: a
        # tool throttling every call held a call without a deadline for ever (the run hung).
        patience = min(limit, started + CLIENT_TIMEOUT_S)
        self.stats.calls += 1
        retries = 0
        while True:
            draw = self._draw(tool, model, arguments, rng, step)
            if draw.fault is not None:
                self.stats.faults[draw.fault.type] = self.stats.faults.get(draw.fault.type, 0) + 1
            first = self._attempt(draw)
            answer, after = first, first.after_s
            window = self._window(tool) if model.idempotent else None
            delay = window.hedge_delay() if window is not None else None
            if delay is not None and first.after_s > delay and now() + delay < limit:
                self.stats.hedges += 1
                second = self._attempt(self._draw(tool, model, arguments, rng, step, hedge=True))
                answer, after = _race(
                    (first, first.after_s), (second, delay + second.after_s), limit - now()
                )
            if answer.status == "timeout" and deadline is None:
                after = self.hang_s  # a hang without a deadline ends when the tool gives up
            at = now() + after
            if at >= limit:
                await asyncio.sleep(max(0.0, limit - now()))
                self.stats.timeouts += 1
                return ToolOutcome(
                    "timeout",
                    now() - started,
                    error="deadline expired",
                    http_status=504,
                    retries_429=retries,
                )
            await asyncio.sleep(after)
            if answer.status == "throttle":
                retries += 1
                self.stats.throttled += 1
                if now() + answer.retry_after_s >= patience:
                    self.stats.timeouts += 1
                    return ToolOutcome(
                        "timeout",
                        now() - started,
                        error=backpressure_gave_up(patience == limit),
                        http_status=429,
                        retries_429=retries,
                    )
                await asyncio.sleep(answer.retry_after_s)
                continue
            if answer.status == "timeout":
                self.stats.timeouts += 1
                return ToolOutcome(
                    "timeout",
                    now() - started,
                    error=answer.error,
                    http_status=504,
                    retries_429=retries,
                )
            if answer.status == "error":
                self.stats.errors += 1
                return ToolOutcome(
                    "error",
                    now() - started,
                    error=answer.error,
                    http_status=200,
                    retries_429=retries,
                )
            if window is not None:
                window.add(after)
            return ToolOutcome(
                "ok", now() - started, result=None, http_status=200, retries_429=retries
            )

    def _window(self, tool: str) -> LatencyWindow | None:
        if self._hedge_factory is None:
            return None
        if tool not in self._windows:
            self._windows[tool] = self._hedge_factory()
        return self._windows[tool]


class _Zero(Sampler):
    """No delay of its own: exact latencies come from the trace, only the fault is drawn."""

    def sample(self, rng: np.random.Generator, step: int | None = None) -> float:
        return 0.0


def _race(
    first: tuple[_Attempt, float], second: tuple[_Attempt, float], left_s: float
) -> tuple[_Attempt, float]:
    """A hedged call's answer and when it comes, as the gateway's `_race` decides: the first
    answer wins unless it failed (5xx, 429) while the other still runs; then the other's answer
    if it comes before the wait for it ends (just before the deadline), else the failure then."""
    (early, early_s), (late, late_s) = sorted((first, second), key=lambda pair: pair[1])
    if not early.failed:
        return early, early_s
    if left_s == math.inf:
        return early, early_s  # no deadline bounds the wait: the gateway answers the failure
    wait_until = max(early_s, left_s - HELD_FAILURE_MARGIN_S)
    if late_s <= wait_until:
        return (early if late.failed else late), late_s  # both failed: the first one held
    return early, wait_until
