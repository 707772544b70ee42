"""The load generator's Python API: `run_load(LoadSpec) -> LoadResult`.

Open loop (constant rate or Poisson arrivals): request *i* has a scheduled send time fixed before
the run starts, and its latency is measured from that scheduled time, so time a request spends
waiting behind a stalled server (or for a free connection) shows in the tail instead of being
silently omitted (no coordinated omission, as in wrk2). Closed loop (N callers, each sending its
next request when the previous one ends) is there for comparison: it hides stalls.

Every run is bounded: `duration_s` and `max_requests` are both required to be finite.

Example (a search emulator on loopback, 200 rps for 10 s, capturing a response header)::

    from stress import LoadSpec, run_load

    result = run_load(LoadSpec(
        url="http://127.0.0.1:8081/retrieve",
        body={"queries": ["who wrote hamlet"], "topk": 3},
        rate=200, duration_s=10, arrival="poisson", seed=1,
        capture_headers=["X-Toolenv-Injected-Delay-Ms"],
    ))
    print(result.summary()["outcomes"]["ok"]["corrected_ms"]["p99"])
    for r in result.records[:3]:  # per-request: scheduled/sent/done (s from start), status, error
        print(r.scheduled_s, r.latency_ms, r.status, r.error, r.headers.get("X-Toolenv-Injected-Delay-Ms"))
    result.histogram("ok").get_value_at_percentile(99.9)  # HdrHistogram in microseconds

`arun_load(spec)` is the same inside a running event loop. `workers=k` splits an open-loop rate
over k processes (each its own loop and connections) and merges their records.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import numpy as np
from hdrh.histogram import HdrHistogram

from .http import (
    ERR_DROPPED,
    ERROR_KINDS,
    Endpoint,
    LoadClient,
    Recorder,
    encode_body,
    encode_request,
)
from .targets import check_loopback

Arrival = Literal["constant", "poisson", "closed"]
HARD_MAX_REQUESTS = 5_000_000
HARD_MAX_DURATION_S = 3600.0
# HdrHistogram range: 1 us .. 1 h, 3 significant digits (0.1% resolution).
HIST_LOWEST_US = 1
HIST_HIGHEST_US = 3_600_000_000
HIST_DIGITS = 3


class LoadSpecError(ValueError):
    """The load specification is unbounded or inconsistent; the message says what to change."""


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
      (0.001 gives sub-ms send precision at the price of a busy core; default 0: timers, ~1 ms).
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
    capture_body_bytes: int = 0

    def validate(self) -> None:
        if not (0 < self.duration_s <= HARD_MAX_DURATION_S):
            raise LoadSpecError(
                f"duration_s must be in (0, {HARD_MAX_DURATION_S:.0f}], got {self.duration_s}"
            )
        if not (0 < self.max_requests <= HARD_MAX_REQUESTS):
            raise LoadSpecError(
                f"max_requests must be in [1, {HARD_MAX_REQUESTS}], got {self.max_requests}"
            )
        if self.arrival not in ("constant", "poisson", "closed"):
            raise LoadSpecError(
                f"arrival must be constant, poisson or closed, got {self.arrival!r}"
            )
        if self.arrival != "closed" and not (0 < self.rate < 1_000_000):
            raise LoadSpecError(
                f"rate must be a positive number of requests per second, got {self.rate}"
            )
        if self.arrival == "closed" and not (1 <= self.concurrency <= 10_000):
            raise LoadSpecError(f"concurrency must be in [1, 10000], got {self.concurrency}")
        if self.max_in_flight < 1 or (self.connections is not None and self.connections < 1):
            raise LoadSpecError("max_in_flight and connections must be at least 1")
        if self.capture_body_bytes < 0:
            raise LoadSpecError(f"capture_body_bytes must be >= 0, got {self.capture_body_bytes}")
        if self.timeout_s <= 0:
            raise LoadSpecError(f"timeout_s must be positive, got {self.timeout_s}")
        if self.workers < 1 or (self.workers > 1 and self.arrival == "closed"):
            raise LoadSpecError("workers > 1 is for open-loop runs (constant or poisson)")

    def planned_requests(self) -> int:
        if self.arrival == "closed":
            return self.max_requests
        return min(self.max_requests, math.ceil(self.rate * self.duration_s))

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


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request. Times are seconds from the run's start; NaN when it never happened."""

    index: int
    scheduled_s: float
    sent_s: float
    done_s: float
    status: int  # HTTP status, 0 when no response
    error: str  # "" or one of http.ERROR_KINDS
    headers: Mapping[str, str]  # captured response headers

    @property
    def latency_ms(self) -> float:
        """From the scheduled send time (coordinated-omission free)."""
        return (self.done_s - self.scheduled_s) * 1000.0

    @property
    def service_ms(self) -> float:
        """From the actual send time (what a naive client reports)."""
        return (self.done_s - self.sent_s) * 1000.0

    @property
    def outcome(self) -> str:
        return outcome_name(self.status, self.error)


def outcome_name(status: int, error: str) -> str:
    if error:
        return error
    return "ok" if 200 <= status < 400 else f"http_{status}"


@dataclass
class LoadResult:
    """Everything one run measured. Arrays are indexed by request, times relative to start."""

    spec: LoadSpec
    start: float  # time.monotonic() of scheduled time 0
    scheduled: np.ndarray
    sent: np.ndarray
    done: np.ndarray
    status: np.ndarray
    error: np.ndarray
    captured: dict[int, dict[str, str]]
    wall_s: float
    connect_errors: list[str] = field(default_factory=list)
    dispatched: np.ndarray | None = None  # when the scheduler handed each request over
    _summary: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    # ---- per request
    @cached_property
    def records(self) -> list[RequestRecord]:
        empty: dict[str, str] = {}
        captured = self.captured
        columns = zip(
            self.scheduled.tolist(),
            self.sent.tolist(),
            self.done.tolist(),
            self.status.tolist(),
            self.error.tolist(),
            strict=True,
        )
        return [
            RequestRecord(i, sc, se, do, st, ERROR_KINDS[er], captured.get(i, empty))
            for i, (sc, se, do, st, er) in enumerate(columns)
        ]

    @cached_property
    def outcomes(self) -> np.ndarray:
        """Outcome name per request ("ok", "http_503", "timeout", ...)."""
        # one name per distinct (status, error) pair, not per request: fast for millions
        keys = self.status.astype(np.int64) * 256 + self.error.astype(np.int64)
        uniq, inverse = np.unique(keys, return_inverse=True)
        table = np.array(
            [outcome_name(int(k) // 256, ERROR_KINDS[int(k) % 256]) for k in uniq.tolist()],
            dtype=object,
        )
        return table[inverse.reshape(-1)] if len(keys) else np.empty(0, dtype=object)

    def captured_values(self, header: str) -> list[str | None]:
        """One captured header's value per request (None where the response lacked it)."""
        return [self.captured.get(i, {}).get(header) for i in range(len(self.scheduled))]

    # ---- latency
    def latencies_ms(self, outcome: str | None = "ok", corrected: bool = True) -> np.ndarray:
        """Latencies in ms of requests with `outcome` (None: every request that got an end)."""
        origin = self.scheduled if corrected else self.sent
        lat = (self.done - origin) * 1000.0
        mask = ~np.isnan(lat)
        if outcome is not None:
            mask &= self.outcomes == outcome
        return lat[mask]

    def histogram(self, outcome: str | None = "ok", corrected: bool = True) -> HdrHistogram:
        """An HdrHistogram of latencies in microseconds (1 us .. 1 h, 3 significant digits)."""
        return make_histogram(self.latencies_ms(outcome, corrected))

    @property
    def scheduling_error_ms(self) -> np.ndarray:
        """The generator's own lateness: scheduler hand-over time minus scheduled time."""
        if self.dispatched is None:
            return self.send_lag_ms
        lag = (self.dispatched - self.scheduled) * 1000.0
        return lag[~np.isnan(lag)]

    @property
    def send_lag_ms(self) -> np.ndarray:
        """Actual send time minus scheduled time: the generator's lateness plus any wait for a
        free or newly opened connection."""
        lag = (self.sent - self.scheduled) * 1000.0
        return lag[~np.isnan(lag)]

    # ---- rates
    @property
    def n(self) -> int:
        return len(self.scheduled)

    @property
    def target_rate(self) -> float | None:
        return None if self.spec.arrival == "closed" else self.spec.rate

    @property
    def achieved_rate(self) -> float:
        """Requests actually sent per second over the sending window (compare with the target:
        below it, the generator or its connections could not keep up)."""
        sent = self.sent[~np.isnan(self.sent)]
        if len(sent) < 2:
            return float(len(sent)) / self.spec.duration_s
        span = float(sent.max())
        if self.target_rate:
            span += 1.0 / self.target_rate
        return len(sent) / span if span > 0 else 0.0

    @property
    def send_rate(self) -> float:
        return self.achieved_rate

    @property
    def throughput(self) -> float:
        """Successful responses per second, until the last response arrived (as vegeta counts).

        Lower than the sent rate when requests fail, or when a slow tail outlives the run."""
        ok = int(np.count_nonzero((self.status >= 200) & (self.status < 400) & (self.error == 0)))
        return ok / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        """The JSON-ready figures (see `stats.summarize`); computed once."""
        from .stats import summarize

        if self._summary is None:
            self._summary = summarize(self)
        return self._summary


def make_histogram(latencies_ms: np.ndarray) -> HdrHistogram:
    hist = HdrHistogram(HIST_LOWEST_US, HIST_HIGHEST_US, HIST_DIGITS)
    if len(latencies_ms):
        us = np.clip(np.rint(latencies_ms * 1000.0), HIST_LOWEST_US, HIST_HIGHEST_US).astype(
            np.int64
        )
        # fold each value onto the lowest value of its histogram bucket first (values in one
        # bucket are indistinguishable at 3 digits), so that few record_value calls remain
        shift = np.maximum(0, np.floor(np.log2(us)).astype(np.int64) - 10)
        us = (us >> shift) << shift
        values, counts = np.unique(us, return_counts=True)
        for v, c in zip(values.tolist(), counts.tolist(), strict=True):
            hist.record_value(v, c)
    return hist


# ------------------------------------------------------------------------------ running


def schedule_offsets(spec: LoadSpec) -> np.ndarray:
    """Scheduled send times (s from start) for an open-loop run, fixed before it starts."""
    n = spec.planned_requests()
    if spec.arrival == "constant":
        return np.arange(n, dtype=np.float64) / spec.rate
    rng = np.random.default_rng(spec.seed)
    gaps = rng.exponential(1.0 / spec.rate, size=n)
    offsets = np.cumsum(gaps) - gaps[0]
    return offsets[offsets < spec.duration_s]


def _request_bytes(spec: LoadSpec, endpoint: Endpoint) -> list[bytes]:
    bodies = spec.bodies if spec.bodies else [spec.body]
    return [encode_request(endpoint, spec.method, encode_body(b), spec.headers) for b in bodies]


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop comes with uvicorn[standard]
        return asyncio.new_event_loop()


def run_load(spec: LoadSpec) -> LoadResult:
    """Run one bounded load test (blocking; uses uvloop). See the module docstring."""
    spec.validate()
    if spec.workers > 1:
        return _run_workers(spec)
    loop = _new_loop()
    try:
        return loop.run_until_complete(arun_load(spec))
    finally:
        loop.close()


async def arun_load(spec: LoadSpec) -> LoadResult:
    """`run_load` inside a running event loop (single process; `workers` is ignored)."""
    spec.validate()
    endpoint = Endpoint.parse(spec.url)
    check_loopback(endpoint.host, allow_remote=spec.allow_remote)
    requests = _request_bytes(spec, endpoint)
    _raise_fd_limit(spec.max_connections() + 256)
    if spec.arrival == "closed":
        return await _closed_loop(spec, endpoint, requests)
    return await _open_loop(spec, endpoint, requests)


def _raise_fd_limit(needed: int) -> None:
    """Lift the soft open-files limit toward the hard one so that many connections can open."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):  # pragma: no cover - best effort
        pass


class _Ticker:
    """Calls `spec.progress` periodically with a snapshot of the recorder."""

    def __init__(self, spec: LoadSpec, rec: Recorder, client_ref: list[LoadClient], start: float):
        self.spec, self.rec, self.client_ref, self.start = spec, rec, client_ref, start
        self.last_t = start
        self.last_completed = 0
        self.task: asyncio.Task[None] | None = None

    def begin(self) -> None:
        if self.spec.progress is not None:
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
            self.snapshot()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.spec.progress_interval_s)
            self.snapshot()

    def snapshot(self) -> None:
        now = time.monotonic()
        rec = self.rec
        done_mask = ~np.isnan(rec.done)
        completed = int(np.count_nonzero(done_mask))
        recent = done_mask & (rec.done >= self.last_t)
        lat = (rec.done[recent] - rec.scheduled[recent]) * 1000.0
        dt = max(1e-9, now - self.last_t)
        client = self.client_ref[0] if self.client_ref else None
        self.spec.progress(  # type: ignore[misc]
            Progress(
                elapsed_s=now - self.start,
                duration_s=self.spec.duration_s,
                scheduled=int(np.count_nonzero(~np.isnan(rec.scheduled) & (rec.scheduled <= now))),
                completed=completed,
                errors=int(np.count_nonzero(done_mask & ((rec.error > 0) | (rec.status >= 400)))),
                in_flight=client.in_flight if client else 0,
                recent_rate=(completed - self.last_completed) / dt,
                recent_p50_ms=float(np.percentile(lat, 50)) if len(lat) else math.nan,
                recent_p99_ms=float(np.percentile(lat, 99)) if len(lat) else math.nan,
            )
        )
        self.last_t = now
        self.last_completed = completed


async def _open_loop(spec: LoadSpec, endpoint: Endpoint, requests: list[bytes]) -> LoadResult:
    offsets = schedule_offsets(spec)
    n = len(offsets)
    rec = Recorder(n)
    client = LoadClient(
        endpoint,
        requests,
        rec,
        max_connections=spec.max_connections(),
        timeout_s=spec.timeout_s,
        capture_headers=spec.capture_headers,
        capture_body_bytes=spec.capture_body_bytes,
    )
    warm = (
        spec.preconnect
        if spec.preconnect is not None
        else min(64, max(2, math.ceil(spec.rate / 250)))
    )
    await client.preconnect(warm)
    start = spec.start_at if spec.start_at is not None else time.monotonic() + 0.01
    rec.scheduled[:] = start + offsets
    ticker = _Ticker(spec, rec, [client], start)
    ticker.begin()
    sched = rec.scheduled
    dispatched = rec.dispatched
    max_in_flight = spec.max_in_flight
    spin = spec.spin_s
    sleep = asyncio.sleep
    monotonic = time.monotonic
    i = 0
    try:
        while i < n:
            now = monotonic()
            while i < n and sched[i] <= now:
                if client.in_flight >= max_in_flight:
                    rec.done[i] = now
                    rec.error[i] = ERR_DROPPED
                else:
                    dispatched[i] = monotonic()
                    client.submit(i)
                i += 1
            if i < n:
                delay = sched[i] - monotonic()
                if delay > spin:
                    await sleep(delay - spin)
                elif delay > 0:
                    await sleep(0)  # poll I/O and come straight back: sub-ms send precision
        await client.drain(spec.timeout_s + 1.0)
    finally:
        await client.aclose()
        await ticker.stop()
    return _result(spec, rec, start, client)


async def _closed_loop(spec: LoadSpec, endpoint: Endpoint, requests: list[bytes]) -> LoadResult:
    cap = spec.max_requests
    rec = Recorder(min(cap, 1_000_000) if cap > 1_000_000 else cap)
    cap = len(rec.scheduled)
    start = spec.start_at if spec.start_at is not None else time.monotonic()
    end = start + spec.duration_s
    next_rid = 0
    finished = asyncio.get_running_loop().create_future()
    client: LoadClient | None = None

    def issue() -> bool:
        nonlocal next_rid
        now = time.monotonic()
        if next_rid >= cap or now >= end:
            return False
        rid = next_rid
        next_rid += 1
        rec.scheduled[rid] = now
        rec.dispatched[rid] = now
        client.submit(rid)  # type: ignore[union-attr]
        return True

    def on_done(_rid: int) -> None:
        if not issue() and client.in_flight == 0 and not finished.done():  # type: ignore[union-attr]
            finished.set_result(None)

    client = LoadClient(
        endpoint,
        requests,
        rec,
        max_connections=spec.max_connections(),
        timeout_s=spec.timeout_s,
        capture_headers=spec.capture_headers,
        on_done=on_done,
        capture_body_bytes=spec.capture_body_bytes,
    )
    if spec.preconnect:  # closed loop: only when asked (connect time then stays off the clock)
        await client.preconnect(spec.preconnect)
        if spec.start_at is None:
            start = time.monotonic()
            end = start + spec.duration_s
    delay = start - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    ticker = _Ticker(spec, rec, [client], start)
    ticker.begin()
    try:
        for _ in range(spec.concurrency):
            if not issue():
                break
        if client.in_flight:
            try:
                await asyncio.wait_for(finished, spec.duration_s + spec.timeout_s + 1.0)
            except TimeoutError:
                pass
        await client.drain(0.0)
    finally:
        await client.aclose()
        await ticker.stop()
    used = next_rid
    rec.scheduled, rec.sent, rec.done = rec.scheduled[:used], rec.sent[:used], rec.done[:used]
    rec.dispatched = rec.dispatched[:used]
    rec.status, rec.error = rec.status[:used], rec.error[:used]
    return _result(spec, rec, start, client)


def _result(spec: LoadSpec, rec: Recorder, start: float, client: LoadClient) -> LoadResult:
    done = rec.done[~np.isnan(rec.done)]
    wall = float(done.max() - start) if len(done) else 0.0
    if spec.arrival != "closed":
        wall = max(wall, spec.duration_s)
    return LoadResult(
        spec=spec,
        start=start,
        scheduled=rec.scheduled - start,
        sent=rec.sent - start,
        done=rec.done - start,
        status=rec.status,
        error=rec.error,
        captured=rec.captured,
        wall_s=wall,
        connect_errors=list(client.connect_errors),
        dispatched=rec.dispatched - start,
    )


# ------------------------------------------------------------------------------ workers


def _worker_main(spec: LoadSpec, index: int, conn: Any) -> None:
    """Runs in a spawned process: wait for the common start instant, run, send arrays back."""
    try:
        start_at = conn.recv()
        spec.start_at = start_at
        result = run_load(spec)
        conn.send(
            (
                result.scheduled,
                result.sent,
                result.done,
                result.status,
                result.error,
                result.captured,
                result.connect_errors,
                result.dispatched,
            )
        )
    except BaseException as exc:  # report, never hang the parent
        conn.send(exc)
    finally:
        conn.close()


def _run_workers(spec: LoadSpec) -> LoadResult:
    """Split an open-loop rate over `spec.workers` processes, interleaved, and merge."""
    k = spec.workers
    endpoint = Endpoint.parse(spec.url)
    check_loopback(endpoint.host, allow_remote=spec.allow_remote)
    ctx = mp.get_context("spawn")
    procs, pipes = [], []
    per_cap = max(1, spec.max_requests // k)
    for w in range(k):
        sub = LoadSpec(
            **{
                **{f: getattr(spec, f) for f in LoadSpec.__dataclass_fields__},
                "rate": spec.rate / k,
                "max_requests": per_cap,
                "max_in_flight": max(1, spec.max_in_flight // k),
                "connections": max(1, spec.max_connections() // k),
                "workers": 1,
                "seed": None if spec.seed is None else spec.seed * 1000 + w,
                "progress": None,
            }
        )
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_worker_main, args=(sub, w, child), daemon=True)
        p.start()
        procs.append(p)
        pipes.append(parent)
    try:
        start = time.monotonic() + 1.5 + 0.2 * k  # spawned interpreters need time to import
        for w, pipe in enumerate(pipes):
            # constant rate: shift worker w by w/rate so the merged stream is evenly spaced
            shift = w / spec.rate if spec.arrival == "constant" else 0.0
            pipe.send(start + shift)
        parts = []
        for pipe in pipes:
            got = pipe.recv()
            if isinstance(got, BaseException):
                raise got
            parts.append(got)
    finally:
        for p in procs:
            p.join(timeout=spec.duration_s + spec.timeout_s + 10)
            if p.is_alive():
                p.kill()
    shifts = [(w / spec.rate if spec.arrival == "constant" else 0.0) for w in range(k)]
    arrays = [
        np.concatenate([p[j] + s for p, s in zip(parts, shifts, strict=True)]) for j in range(3)
    ]
    dispatched = np.concatenate([p[7] + s for p, s in zip(parts, shifts, strict=True)])
    status = np.concatenate([p[3] for p in parts])
    error = np.concatenate([p[4] for p in parts])
    order = np.argsort(arrays[0], kind="stable")
    captured: dict[int, dict[str, str]] = {}
    base = 0
    old_to_new = np.empty(len(order), dtype=np.int64)
    old_to_new[order] = np.arange(len(order))
    for p in parts:
        for i, h in p[5].items():
            captured[int(old_to_new[base + i])] = h
        base += len(p[0])
    done = arrays[2][order]
    finite = done[~np.isnan(done)]
    wall = max(float(finite.max()) if len(finite) else 0.0, spec.duration_s)
    return LoadResult(
        spec=spec,
        start=start,
        scheduled=arrays[0][order],
        sent=arrays[1][order],
        done=done,
        status=status[order],
        error=error[order],
        captured=captured,
        wall_s=wall,
        connect_errors=[e for p in parts for e in p[6]][:5],
        dispatched=dispatched[order],
    )


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
