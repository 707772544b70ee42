"""Every HTTP header toolenv speaks, named once.

Receivers compare case-insensitively (HTTP says so); the spellings here are what senders send.
`FORWARDED_CALL_HEADERS` are the call-context headers the gateway passes on to every tool, embedded
or proxied, so that a drifting latency profile sees the training step it drifts by.
"""

from __future__ import annotations

from collections.abc import Mapping

DEADLINE = "X-Toolenv-Deadline-Ms"
"""Remaining budget of the call in milliseconds, re-based on each hop's own clock."""

INJECTED_DELAY = "X-Toolenv-Injected-Delay-Ms"
"""What an emulator scheduled for this call (its draw from the latency profile)."""

TIMER_ERROR = "X-Toolenv-Timer-Error-Ms"
"""When the emulator's handler woke, minus the scheduled delay (measured around its own sleep).
It wakes `PACING_LEAD` early on purpose, so this is about minus that lead when all is well."""

PACING_LEAD = "X-Toolenv-Pacing-Lead-Ms"
"""How early the emulator woke on purpose: the running median of its measured response path
(wake-up overshoot + building + writing the reply), so that the reply leaves on schedule, plus
that of its loop's intake latency (how long a request waits in its socket before it is stamped,
estimated by the timer's own overshoot)."""

FAULT = "X-Toolenv-Fault"
"""Which injected fault (error, hang, throttle, slow body) shaped this reply, if any."""

TRAJECTORY = "X-Trajectory-Id"
"""The rollout trajectory a call belongs to: what trace capture groups by."""

TRAJECTORY_MAX_CHARS = 256
"""The longest `X-Trajectory-Id` the gateway takes (longer is a 400, never cut: two ids that
share their first characters would become one trajectory)."""

STEP = "X-Step"
"""The training step of the call: what drifting latency profiles drift by."""

TURN = "X-Turn"
"""The turn within the trajectory."""

EXECUTOR_NODE = "X-Toolenv-Node"
"""The node a call ran on (Ray: the node's address and id), so a run says where it ran."""

EXECUTOR_REPLICA = "X-Toolenv-Replica"
"""The replica a call ran on (Ray Serve's replica id)."""

DEADLINE_EXPIRED = "X-Toolenv-Deadline-Expired"
"""Set (to `1`) by a tool on an answer whose call its deadline ended (sandboxd: a run cut at the
deadline it was sent, answered as SandboxFusion's TimeLimitExceeded with the output so far; not
a program's own `run_timeout`; the emulators: a 504 at a deadline, not an `error` fault's). The
gateway counts such a call as its `timeout`, as a 504 at the deadline the tool was told."""

TOOL_STATUS = "X-Toolenv-Tool-Status"
"""The gateway's generic call answers 200 for a tool that answered, its own error included: this
header carries the answer's `status` (`ok`, or `error` for the tool's error answer), so a load
generator counts the tool's errors without reading the body."""

REQUEST_ID = "X-Request-Id"
"""The gateway's id for one call, echoed in logs and error bodies."""

FORWARDED_CALL_HEADERS: tuple[str, ...] = (TRAJECTORY, STEP, TURN)


class HeaderError(ValueError):
    """A header toolenv reads is present but malformed: the message names it and what to send."""


def quoted(value: str) -> str:
    """A bad header value as an error quotes it: whole when short, not a 5 kB value echoed."""
    return repr(value) if len(value) <= 40 else f"{value[:20]!r}... ({len(value)} characters)"


COUNT_MAX = 2**63 - 1
"""The largest `X-Step` / `X-Turn` taken: a 64-bit count, what every trace reader can store (a
longer one was read whole, and past Python's 4300-digit conversion limit it was a 500)."""
_COUNT_DIGITS = len(str(COUNT_MAX))


def count_header(name: str, value: str | None) -> int | None:
    """A non-negative integer header (`X-Step`, `X-Turn`): None when absent; ASCII digits only, so
    `-3`, `+3`, `1.5` or `²` are refused rather than read as something the caller did not send;
    at most `COUNT_MAX`."""
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()):
        raise HeaderError(f"{name} must be a non-negative integer (0, 1, 2, ...), got {value!r}")
    # the length first: int() of a string past 4300 digits raises (it was a 500)
    digits = value if len(value) <= _COUNT_DIGITS else value.lstrip("0") or "0"
    count = int(digits) if len(digits) <= _COUNT_DIGITS else None
    if count is None or count > COUNT_MAX:
        raise HeaderError(
            f"{name} must be at most {COUNT_MAX} (a 64-bit count), got {quoted(value)}"
        )
    return count


def trajectory_header(value: str | None) -> str | None:
    """`X-Trajectory-Id` as the caller wrote it (None when absent); raises HeaderError beyond the
    limit. HTTP servers hand header bytes over decoded as Latin-1: an id sent in UTF-8 is read
    back as UTF-8, so that the capture records the id the caller sent, not mojibake of it."""
    if value is not None and not value.isascii():
        try:
            value = value.encode("latin-1").decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError):
            pass  # not UTF-8: the Latin-1 reading stands
    if value is not None and len(value) > TRAJECTORY_MAX_CHARS:
        raise HeaderError(
            f"{TRAJECTORY} must be at most {TRAJECTORY_MAX_CHARS} characters, got {len(value)} "
            "(send a shorter id, e.g. a hash of the long one)"
        )
    return value


def header(headers: Mapping[str, str], name: str) -> str | None:
    """A header's value from a mapping whose keys may be any case (ASGI lowers them)."""
    value = headers.get(name)
    if value is None:
        value = headers.get(name.lower())
    return value


def forwarded_call_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The call-context headers present in `headers`, spelled as senders spell them."""
    out: dict[str, str] = {}
    for name in FORWARDED_CALL_HEADERS:
        value = header(headers, name)
        if value is not None:
            out[name] = value
    return out
