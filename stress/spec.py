"""What to send, how fast, and for how long: `LoadSpec`, its checks and its schedule.

Every run is bounded: `duration_s` and `max_requests` are both required to be finite.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from toolenv_core.http1 import Endpoint

Arrival = Literal["constant", "poisson", "closed"]
HARD_MAX_REQUESTS = 5_000_000
HARD_MAX_DURATION_S = 3600.0
HARD_MAX_RATE = 1_000_000  # rps, exclusive
HARD_MAX_WORKERS = 64  # each a spawned interpreter, started 0.2 s apart

# RFC 9110: a method or a header name is a token; a header value is visible Latin-1, spaces and
# tabs (a CR or LF would end the header and start another one the caller never wrote)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")


class LoadSpecError(ValueError):
    """The load specification is unbounded or inconsistent; the message says what to change.

    `template` names the `LoadSpec` fields it is about as `{field}` (its other values as
    keyword arguments): `str()` spells them as the fields, `worded` as the caller's own names
    for them (`toolenv stress`: the options the user typed, `--duration` for `duration_s`)."""

    def __init__(self, template: str, **values: object) -> None:
        self.template, self.values = template, values
        super().__init__(self.worded({}))

    def worded(self, names: Mapping[str, str]) -> str:
        fields = {f.name: names.get(f.name, f.name) for f in dataclasses.fields(LoadSpec)}
        return self.template.format(**fields, **self.values)


@dataclass(slots=True)
class LoadSpec:
    """What to send, how fast, and for how long.

    - `url`: a plain http:// URL; off-loopback hosts are refused unless `allow_remote`.
    - `body` / `bodies`: one JSON body (dict/list, str or bytes), or several cycled per request.
    - `arrival`: "constant" or "poisson" (open loop at `rate` rps) or "closed" (`concurrency`
      callers back to back).
    - `max_in_flight`: an open-loop request scheduled while this many are outstanding is
      recorded as error "dropped" (never sent) rather than queued without bound.
    - `connections`: keep-alive connections to open at most (default: `concurrency` for closed
      loop, else `max_in_flight`, so every in-flight request is on the wire); requests beyond
      them wait for a free one, and that wait counts in their latency.
    - `capture_headers`: response header values kept per request (case-insensitive names).
    - `capture_body_bytes`: keep the first this many bytes of each response body, decoded as
      UTF-8, among the request's captured values under `http.BODY_KEY` (":body"); 0: none.
    - `start_at`: a `time.monotonic()` instant to start at (used to align worker processes).
    - `preconnect`: connections opened before the clock starts (open loop default: rate/250,
      2..64; closed loop default: none, each caller connects on its first request).
    - `spin_s`: poll the loop instead of sleeping for the last `spin_s` before each send
      (0.001 gives sub-ms send precision at the price of a busy core; default 0: the loop's
      millisecond timers, except that uvloop runs a wait under 0.5 ms at once, so the last half
      millisecond before a send is polled: 58-77% of a core at 2,000-4,000 rps, measured).
    - `precise_sends`: wake for each open-loop send from a timerfd (`toolenv_core.timer`, to the
      microsecond) instead of the loop's millisecond timers, which send up to a millisecond late
      (0.2-0.3 ms at the median at 1,000 rps): for measuring sub-ms timing. The wake-up itself
      costs the loop's latency (~0.05-0.1 ms); with `spin_s=0.0001` as well (woken 0.1 ms early,
      polled for the rest: ~10% of a core at 1,000 rps) sends leave a few us after schedule.
    - `interruptible`: Ctrl-C (SIGINT) ends the run early with what it measured
      (`LoadResult.interrupted`) instead of raising KeyboardInterrupt (`toolenv stress` sets it;
      a script driving several runs keeps Ctrl-C for itself).
    """

    url: str
    body: bytes | str | Mapping[str, Any] | Sequence[Any] | None = None
    bodies: Sequence[bytes | str | Mapping[str, Any]] | None = None
    method: str = "POST"
    headers: Mapping[str, str] = field(default_factory=dict)
    arrival: Arrival = "constant"
    rate: float = 100.0
    concurrency: int = 16
    duration_s: float = 10.0
    max_requests: int = 1_000_000
    max_in_flight: int = 10_000
    connections: int | None = None
    timeout_s: float = 30.0
    capture_headers: Sequence[str] = ()
    seed: int | None = None
    workers: int = 1
    allow_remote: bool = False
    progress: Callable[[Progress], None] | None = None
    progress_interval_s: float = 0.5
    start_at: float | None = None
    preconnect: int | None = None
    spin_s: float = 0.0
    precise_sends: bool = False
    capture_body_bytes: int = 0
    interruptible: bool = False

    def validate(self) -> None:
        if not (0 < self.duration_s <= HARD_MAX_DURATION_S):
            raise LoadSpecError(
                "{duration_s} must be in (0, {most:.0f}], got {got}",
                most=HARD_MAX_DURATION_S,
                got=self.duration_s,
            )
        if not (0 < self.max_requests <= HARD_MAX_REQUESTS):
            raise LoadSpecError(
                "{max_requests} must be in [1, {most}], got {got}",
                most=HARD_MAX_REQUESTS,
                got=self.max_requests,
            )
        if self.arrival not in ("constant", "poisson", "closed"):
            raise LoadSpecError(
                "{arrival} must be constant, poisson or closed, got {got!r}", got=self.arrival
            )
        if self.arrival != "closed" and not (0 < self.rate < HARD_MAX_RATE):
            raise LoadSpecError(
                "{rate} must be a positive number of requests per second, got {got}",
                got=self.rate,
            )
        if self.arrival == "closed" and not (1 <= self.concurrency <= 10_000):
            raise LoadSpecError(
                "{concurrency} must be in [1, 10000], got {got}", got=self.concurrency
            )
        if self.max_in_flight < 1 or (self.connections is not None and self.connections < 1):
            raise LoadSpecError("{max_in_flight} and {connections} must be at least 1")
        if self.capture_body_bytes < 0:
            raise LoadSpecError(
                "{capture_body_bytes} must be >= 0, got {got}", got=self.capture_body_bytes
            )
        if self.timeout_s <= 0:
            raise LoadSpecError("{timeout_s} must be positive, got {got}", got=self.timeout_s)
        if not (1 <= self.workers <= HARD_MAX_WORKERS):
            raise LoadSpecError(
                "{workers} must be at least 1 and at most {most}, got {got}",
                most=HARD_MAX_WORKERS,
                got=self.workers,
            )
        if self.seed is not None and self.seed < 0:  # numpy's generator took it: a traceback
            raise LoadSpecError("{seed} must be >= 0, got {got}", got=self.seed)
        if self.preconnect is not None and self.preconnect < 0:
            raise LoadSpecError("{preconnect} must be >= 0, got {got}", got=self.preconnect)
        if self.workers > self.max_requests:
            raise LoadSpecError(
                "{workers} ({n}) is more than {max_requests} ({cap}): each generator process "
                "sends at least one request; lower {workers}",
                n=self.workers,
                cap=self.max_requests,
            )
        if self.arrival == "constant" and self.workers > self.planned_requests():
            raise LoadSpecError(
                "{workers} ({n}) is more than the requests scheduled at {rate} ({r:g}) over "
                "{duration_s} ({d:g} s), {planned}: each generator process sends at least one "
                "request; lower {workers}",
                n=self.workers,
                r=self.rate,
                d=self.duration_s,
                planned=self.planned_requests(),
            )
        if self.workers > 1 and self.arrival == "closed":
            raise LoadSpecError("{workers} > 1 is for open-loop runs (constant or poisson)")
        if self.workers > min(self.max_in_flight, self.max_connections()):
            # each took at least one: 2 workers under --max-in-flight 1 had 2 requests out
            raise LoadSpecError(
                "{workers} ({n}) is more than {max_in_flight} or {connections} allow: each "
                "generator process has at least one of them; lower {workers}",
                n=self.workers,
            )
        self._check_head()

    def _check_head(self) -> None:
        """What goes into each request's head is sent as written: refuse what HTTP/1.1 cannot
        carry (it was a traceback, a header smuggled in by a CR LF, or a run of 400s)."""
        path = Endpoint.parse(self.url).path
        if not path.isascii() or not path.isprintable() or " " in path:
            raise LoadSpecError(
                "URL {got!r}: the path may hold only printable ASCII without spaces; "
                "percent-encode the rest (%20 for a space)",
                got=self.url,
            )
        if not _TOKEN.fullmatch(self.method):
            raise LoadSpecError(
                "{method} {got!r} is not an HTTP method (like POST or GET)", got=self.method
            )
        for name in [*self.headers, *self.capture_headers]:
            if not _TOKEN.fullmatch(name):
                raise LoadSpecError(
                    "header name {got!r} must be letters, digits and !#$%&'*+-.^_`|~ only",
                    got=name,
                )
        for name, value in self.headers.items():
            if name.lower() in ("content-length", "transfer-encoding"):
                # sent beside the generator's own: two lengths, or a body read as the next request
                raise LoadSpecError(
                    "header {header}: each request's body is framed by the generator itself "
                    "(its Content-Length is sent); drop this header",
                    header=name,
                )
            if not _FIELD_VALUE.fullmatch(value):
                raise LoadSpecError(
                    "header {header}: value {got!r} holds a control character (CR, LF, NUL) "
                    "or a character outside Latin-1",
                    header=name,
                    got=value,
                )

    def planned_requests(self) -> int:
        """The most requests the run may send: the cap, or fewer when the schedule holds fewer."""
        if self.arrival == "closed":
            return self.max_requests
        return min(self.max_requests, self._schedule_bound())

    def _schedule_bound(self) -> int:
        """The most requests an open-loop schedule holds. A Poisson count is random: its draws
        reach past the window's end all but surely (mean + 8 sd); exactly the mean ran out
        before the end in 45% of runs (20 s at 200 rps: up to 0.7 s without a request)."""
        mean = self.rate * self.duration_s
        if self.arrival == "poisson":
            return math.ceil(mean + 8 * math.sqrt(mean) + 16)
        return math.ceil(mean)

    def worker_cap(self, index: int = 0) -> int:
        """Generator process `index`'s share of the run's requests. The first `total % workers`
        send one more, so the shares add up (each took `max_requests // workers`, at least 1: 4
        workers sent 4 requests under a cap of 3, 2 workers 2 under a cap of 3); their schedules
        interleave, so these are the schedule's first requests. At a constant rate the total is
        the planned count, as one process sends it: each worker's own ceil(rate / k x duration)
        added up past it (10,002 requests at 1,000 rps for 10 s on 3 workers, the last ones due
        after the duration)."""
        total = self.planned_requests() if self.arrival == "constant" else self.max_requests
        share, extra = divmod(total, self.workers)
        return share + (index < extra)

    def request_cap(self) -> int | None:
        """The request cap when it may stop the run before `duration_s` (None when it cannot):
        always in a closed loop (how many fit depends on the target), in an open loop when the
        schedule holds more requests than the cap."""
        cap = self.max_requests
        if self.arrival == "closed" or cap < self.rate * self.duration_s:
            return cap
        if self.arrival == "poisson" and cap < self._schedule_bound():
            return cap  # the random count may reach it
        return None

    def open_loop_span_s(self, n: int) -> float:
        """How long an open-loop schedule of `n` requests lasts: the whole `duration_s`, unless
        `max_requests` cut it short (2 requests at 100 rps span 0.02 s, not the duration)."""
        return min(self.duration_s, n / self.rate)

    def max_connections(self) -> int:
        if self.connections is not None:
            return self.connections
        if self.arrival == "closed":
            return self.concurrency
        return self.max_in_flight


@dataclass(frozen=True, slots=True)
class Progress:
    """A live snapshot, passed to `LoadSpec.progress` every `progress_interval_s`."""

    elapsed_s: float
    duration_s: float
    scheduled: int
    completed: int
    errors: int
    in_flight: int
    recent_rate: float
    recent_p50_ms: float
    recent_p99_ms: float

    @staticmethod
    def merge(parts: Sequence[Progress]) -> Progress:
        """The generator processes' latest snapshots as one: counts and rates add up; the
        latencies are the worst process's (percentiles of parts do not add up to the whole's)."""

        def worst(values: Iterable[float]) -> float:
            return max((v for v in values if not math.isnan(v)), default=math.nan)

        return Progress(
            elapsed_s=max(p.elapsed_s for p in parts),
            duration_s=parts[0].duration_s,
            scheduled=sum(p.scheduled for p in parts),
            completed=sum(p.completed for p in parts),
            errors=sum(p.errors for p in parts),
            in_flight=sum(p.in_flight for p in parts),
            recent_rate=sum(p.recent_rate for p in parts),
            recent_p50_ms=worst(p.recent_p50_ms for p in parts),
            recent_p99_ms=worst(p.recent_p99_ms for p in parts),
        )


def schedule_offsets(spec: LoadSpec) -> np.ndarray:
    """Scheduled send times (s from start) for an open-loop run, fixed before it starts."""
    n = spec.planned_requests()
    if spec.arrival == "constant":
        return np.arange(n, dtype=np.float64) / spec.rate
    rng = np.random.default_rng(spec.seed)
    gaps = rng.exponential(1.0 / spec.rate, size=n)  # the cap's first arrivals, when it is less
    offsets = np.cumsum(gaps) - gaps[0]
    return offsets[offsets < spec.duration_s]
