"""One absolute deadline per call, carried across HTTP hops as remaining milliseconds.

Every hop (gateway, sandboxd, emulators) turns the header into a `Deadline` on its own monotonic
clock, so clocks never need to agree between processes; only the remaining budget travels.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

DEADLINE_HEADER = "X-Toolenv-Deadline-Ms"


class DeadlineHeaderError(ValueError):
    """The deadline header is present but not a non-negative number of milliseconds."""


@dataclass(frozen=True, slots=True)
class Deadline:
    """An absolute point on this process's monotonic clock by which a call must be answered."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + max(0.0, seconds))

    @classmethod
    def never(cls) -> Deadline:
        return cls(math.inf)

    def remaining(self) -> float:
        """Seconds left (never negative; `inf` for a deadline that never comes)."""
        return max(0.0, self.at - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def earliest(self, other: Deadline | None) -> Deadline:
        return self if other is None or self.at <= other.at else other

    def to_header_value(self) -> str:
        """Remaining milliseconds as sent in `X-Toolenv-Deadline-Ms`."""
        return str(int(self.remaining() * 1000)) if self.at != math.inf else "0"

    def headers(self) -> dict[str, str]:
        if self.at == math.inf:
            return {}
        return {DEADLINE_HEADER: self.to_header_value()}


def parse_deadline_ms(value: str) -> float:
    """Parse a header value into seconds, with an error message that says what to send."""
    try:
        ms = float(value)
    except ValueError as exc:
        raise DeadlineHeaderError(
            f"{DEADLINE_HEADER} must be a number of milliseconds, got {value!r}"
        ) from exc
    if not math.isfinite(ms) or ms < 0:
        raise DeadlineHeaderError(
            f"{DEADLINE_HEADER} must be a finite, non-negative number of milliseconds, got {value!r}"
        )
    return ms / 1000.0


def deadline_from_headers(
    headers: Mapping[str, str], *, default_s: float | None, max_s: float | None
) -> Deadline:
    """Build the deadline of an incoming request, bounded by configuration.

    Missing header: `default_s` (or no deadline when that is None). Present: clamped to `max_s`.
    """
    raw = headers.get(DEADLINE_HEADER) or headers.get(DEADLINE_HEADER.lower())
    seconds = parse_deadline_ms(raw) if raw is not None else default_s
    if seconds is None:
        return Deadline.never()
    if max_s is not None:
        seconds = min(seconds, max_s)
    return Deadline.after(seconds)
