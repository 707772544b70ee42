"""One absolute deadline per call, carried across HTTP hops as remaining milliseconds.

Every hop (gateway, sandboxd, emulators) turns the header into a `Deadline` on its own monotonic
clock, so clocks never need to agree between processes; only the remaining budget travels.
`DeadlinePolicy` is the one rule every hop applies to what a caller sent: a default when nothing
was sent, a cap on what was, and the earlier of a body's `deadline_ms` and the header.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from .headers import DEADLINE as DEADLINE_HEADER
from .headers import HeaderError, header, quoted

HEADER_RESOLUTION_S = 0.001
"""The header counts whole milliseconds: a deadline less than this away is sent as `0`, which
every hop reads as already expired."""


def header_value_at(at: float) -> str:
    """The header value for a deadline at `at` (finite) on this process's monotonic clock: the
    milliseconds left now, never negative. What `Deadline.to_header_value` sends; hot paths call
    it without making a `Deadline`."""
    return str(int(max(0.0, at - time.monotonic()) * 1000))


class DeadlineHeaderError(HeaderError):
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

    @property
    def bounded(self) -> bool:
        return self.at != math.inf

    def to_header_value(self) -> str:
        """Remaining milliseconds as sent in `X-Toolenv-Deadline-Ms`.

        A deadline that never comes has no header value (a receiver would read "0" as expired):
        send no header at all, as `headers()` does.
        """
        if not self.bounded:
            raise ValueError("a deadline that never comes is sent as no header, not as a value")
        return header_value_at(self.at)

    def headers(self) -> dict[str, str]:
        if self.at == math.inf:
            return {}
        return {DEADLINE_HEADER: self.to_header_value()}


def parse_deadline_ms(value: str) -> float:
    """Parse a header value into seconds, with an error message that says what to send."""
    try:
        if "_" in value:  # Python's float() reads "1_000"; no other HTTP client's parser does
            raise ValueError(value)
        ms = float(value)
    except ValueError as exc:
        raise DeadlineHeaderError(
            f"{DEADLINE_HEADER} must be a number of milliseconds, got {quoted(value)}"
        ) from exc
    if not math.isfinite(ms) or ms < 0:
        raise DeadlineHeaderError(
            f"{DEADLINE_HEADER} must be a finite, non-negative number of milliseconds, "
            f"got {quoted(value)}"
        )
    return ms / 1000.0


@dataclass(frozen=True, slots=True)
class DeadlinePolicy:
    """How a hop turns what the caller sent into a deadline: the one rule, in seconds.

    - Nothing sent: `default_s` from now (no deadline at all when `default_s` is None).
    - A header and/or a body `deadline_ms`: the earlier of the two wins.
    Whatever the source, the budget is capped at `max_s`.
    """

    default_s: float | None = None
    max_s: float | None = None

    def __post_init__(self) -> None:
        for name, value in (("default_s", self.default_s), ("max_s", self.max_s)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"DeadlinePolicy.{name} must be a positive number of seconds")

    @classmethod
    def from_ms(cls, default_ms: float | None, max_ms: float | None) -> DeadlinePolicy:
        return cls(
            None if default_ms is None else default_ms / 1000.0,
            None if max_ms is None else max_ms / 1000.0,
        )

    def budget_s(self, header_value: str | None, body_ms: float | None = None) -> float | None:
        """Seconds granted to the call (None: unbounded); raises DeadlineHeaderError."""
        seconds = parse_deadline_ms(header_value) if header_value is not None else None
        if body_ms is not None and (seconds is None or body_ms / 1000.0 < seconds):
            seconds = body_ms / 1000.0
        if seconds is None:
            seconds = self.default_s
            if seconds is None:
                return None
        if self.max_s is not None and seconds > self.max_s:
            return self.max_s
        return seconds + 0.0  # a "-0" sent is 0 (-0.0 was told back as `"deadline_ms": -0.0`)

    def deadline(self, header_value: str | None, body_ms: float | None = None) -> Deadline:
        seconds = self.budget_s(header_value, body_ms)
        return Deadline.never() if seconds is None else Deadline.after(seconds)

    def from_headers(self, headers: Mapping[str, str], body_ms: float | None = None) -> Deadline:
        return self.deadline(header(headers, DEADLINE_HEADER), body_ms)


def deadline_from_headers(
    headers: Mapping[str, str], *, default_s: float | None, max_s: float | None
) -> Deadline:
    """Build the deadline of an incoming request, bounded by configuration (see DeadlinePolicy)."""
    return DeadlinePolicy(default_s, max_s).from_headers(headers)
