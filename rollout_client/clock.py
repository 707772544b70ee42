"""The rollout's clock: the running event loop's `time()`, wall or virtual.

Every timing in the runner, the engines' monitor and the simulated tools reads `now()`, the
running loop's clock. Under the default loop that is `time.monotonic()` (live rollouts); under
`VirtualEventLoop` it is a simulated clock that jumps to the next timer whenever every task
waits, so a rollout that models minutes of GPU and tool time runs as fast as the CPU allows and
is deterministic: nothing sleeps, nothing depends on how fast this machine is.
"""

from __future__ import annotations

import asyncio
import math
import selectors
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def now() -> float:
    """Seconds on the running loop's clock (monotonic outside a loop)."""
    try:
        return asyncio.get_running_loop().time()
    except RuntimeError:
        return time.monotonic()


class VirtualTimeDeadlock(RuntimeError):
    """Every task waits, no timer is set and nothing else can wake them: the run can never end."""


# Past this much simulated time (about 32 years) a run is waiting on something that never ends
# in practice: a tool latency of 1e308 s or +inf (an overflowed draw). asyncio caps each wait at
# one day, so without a horizon such a run would step the clock a day at a time, for ever.
HORIZON_S = 1e9


class _VirtualSelector(selectors.DefaultSelector):
    """A selector that never blocks: a wait of `timeout` seconds moves the virtual clock instead."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = 0.0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready:
            return ready
        if timeout is None:
            raise VirtualTimeDeadlock(
                "virtual time: every task waits and no timer is set (a wait that nothing ends)"
            )
        if timeout > 0:
            if self.clock + timeout > HORIZON_S:
                raise VirtualTimeDeadlock(
                    f"virtual time passed {HORIZON_S:.0e} s: a wait that never ends in practice "
                    "(a tool latency of +inf or 1e308 s?); cap the latency profile with max_s or "
                    "add a timeout policy (or an engine cost profile's costs are that large)"
                )
            self.clock += timeout
        return []


class VirtualEventLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on a simulated clock that starts at 0 and advances only between events."""

    def __init__(self) -> None:
        self._virtual = _VirtualSelector()
        self._resolution = time.get_clock_info("monotonic").resolution
        super().__init__(self._virtual)

    def time(self) -> float:
        return self._virtual.clock

    # asyncio runs the timers due before `time() + _clock_resolution`. Past about 1.7e7 s of
    # virtual time a float's step exceeds twice the monotonic clock's 1 ns, `now + 1 ns` rounds
    # to `now`, and a timer due now never ran: the clock never moved again and the run spun for
    # ever (a tool latency of 1e8 s, well under the horizon). One step of the clock at least.
    @property
    def _clock_resolution(self) -> float:
        return max(self._resolution, math.ulp(self._virtual.clock))

    @_clock_resolution.setter
    def _clock_resolution(self, value: float) -> None:  # asyncio's own __init__ sets it
        self._resolution = value


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on a `VirtualEventLoop` (a fresh loop per run, closed at the end)."""
    with asyncio.Runner(loop_factory=VirtualEventLoop) as runner:
        return runner.run(main)
