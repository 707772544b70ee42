"""Running a load: `run_load(LoadSpec) -> LoadResult` (the load generator's Python API).

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
import contextlib
import math
import resource
import time

import numpy as np
import uvloop

from toolenv_core.http1 import ERR_DROPPED, Endpoint
from toolenv_core.timer import sleep_until

from .http import LoadClient, Recorder, encode_body, encode_request
from .interrupt import (
    GRACE_S,
    Stop,
    on_sigint,
    until,
)
from .result import LoadResult
from .spec import LoadSpec, Progress, schedule_offsets
from .targets import check_loopback
from .workers import run_workers


def _request_bytes(spec: LoadSpec, endpoint: Endpoint) -> list[bytes]:
    bodies = spec.bodies if spec.bodies else [spec.body]
    return [encode_request(endpoint, spec.method, encode_body(b), spec.headers) for b in bodies]


WAKE_S = 0.05  # the longest the sender sleeps between checks for Ctrl-C


def _new_loop() -> asyncio.AbstractEventLoop:
    return uvloop.new_event_loop()


def run_load(spec: LoadSpec) -> LoadResult:
    """Run one bounded load test (blocking; uses uvloop). See the module docstring."""
    spec.validate()
    if spec.workers > 1:
        return run_workers(spec, run_load)
    loop = _new_loop()
    stop = Stop()
    try:
        with on_sigint(loop, stop) if spec.interruptible else contextlib.nullcontext():
            return loop.run_until_complete(_arun(spec, stop))
    finally:
        loop.close()


async def arun_load(spec: LoadSpec) -> LoadResult:
    """`run_load` inside a running event loop (single process; `workers` is ignored)."""
    return await _arun(spec, Stop())


async def _arun(spec: LoadSpec, stop: Stop) -> LoadResult:
    spec.validate()
    endpoint = Endpoint.parse(spec.url)
    check_loopback(endpoint.host, allow_remote=spec.allow_remote)
    requests = _request_bytes(spec, endpoint)
    _raise_fd_limit(spec.max_connections() + 256)
    if spec.arrival == "closed":
        return await _closed_loop(spec, endpoint, requests, stop)
    return await _open_loop(spec, endpoint, requests, stop)


def _raise_fd_limit(needed: int) -> None:
    """Lift the soft open-files limit toward the hard one so that many connections can open."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):  # pragma: no cover - best effort
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


async def _open_loop(
    spec: LoadSpec, endpoint: Endpoint, requests: list[bytes], stop: Stop
) -> LoadResult:
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
        head_only=spec.method.upper() == "HEAD",
    )
    warm = (
        spec.preconnect
        if spec.preconnect is not None
        else min(64, max(2, math.ceil(spec.rate / 250)))
    )
    await _preconnect(client, warm, stop)
    start = spec.start_at if spec.start_at is not None else time.monotonic() + 0.01
    rec.scheduled[:] = start + offsets
    ticker = _Ticker(spec, rec, [client], start)
    ticker.begin()
    sched = rec.scheduled
    dispatched = rec.dispatched
    max_in_flight = spec.max_in_flight
    spin = spec.spin_s
    precise = spec.precise_sends
    sleep = asyncio.sleep
    monotonic = time.monotonic
    i = 0
    try:
        while i < n and not stop.is_set():
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
                if precise and delay > spin:
                    await sleep_until(min(sched[i] - spin, monotonic() + WAKE_S))
                elif delay > spin:
                    await sleep(min(delay - spin, WAKE_S))
                elif delay > 0:
                    await sleep(0)  # poll I/O and come straight back: sub-ms send precision
        if i < n:  # stopped by Ctrl-C: the requests not yet due are no part of the run
            _trim(rec, i)
            offsets = offsets[:i]
        draining = asyncio.ensure_future(client.drain(spec.timeout_s + 1.0))
        await until(draining, None, stop)
        if not draining.done():
            draining.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await draining
        if stop.is_set():
            await client.drain(GRACE_S)
    finally:
        await client.aclose()
        await ticker.stop()
    return _result(spec, rec, start, client, offsets, interrupted=stop.is_set())


async def _closed_loop(
    spec: LoadSpec, endpoint: Endpoint, requests: list[bytes], stop: Stop
) -> LoadResult:
    cap = spec.max_requests  # all of it: cut to a million, the run stopped there, "by --duration"
    rec = Recorder(cap)
    start = spec.start_at if spec.start_at is not None else time.monotonic()
    end = start + spec.duration_s
    next_rid = 0
    finished = asyncio.get_running_loop().create_future()
    client: LoadClient | None = None

    def issue() -> bool:
        nonlocal next_rid
        now = time.monotonic()
        if next_rid >= cap or now >= end or stop.is_set():
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
        head_only=spec.method.upper() == "HEAD",
    )
    if spec.preconnect:  # closed loop: only when asked (connect time then stays off the clock)
        await _preconnect(client, spec.preconnect, stop)
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
            await until(finished, spec.duration_s + spec.timeout_s + 1.0, stop)
        await client.drain(GRACE_S if stop.is_set() else 0.0)
    finally:
        await client.aclose()
        await ticker.stop()
    _trim(rec, next_rid)
    return _result(spec, rec, start, client, interrupted=stop.is_set())


async def _preconnect(client: LoadClient, count: int, stop: Stop) -> None:
    """`client.preconnect`, given up at Ctrl-C: a target that never accepts held Ctrl-C off for
    the whole `--timeout` (each connect's bound)."""
    task = asyncio.ensure_future(client.preconnect(count))
    await until(task, None, stop)
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _trim(rec: Recorder, used: int) -> None:
    """Keep the first `used` requests (views: the client still writes those in flight)."""
    rec.scheduled, rec.sent, rec.done = rec.scheduled[:used], rec.sent[:used], rec.done[:used]
    rec.dispatched = rec.dispatched[:used]
    rec.status, rec.error = rec.status[:used], rec.error[:used]


def _result(
    spec: LoadSpec,
    rec: Recorder,
    start: float,
    client: LoadClient,
    offsets: np.ndarray | None = None,
    *,
    interrupted: bool = False,
) -> LoadResult:
    """Times relative to `start`. An open loop passes its exact `offsets` as the scheduled
    times: `(start + offsets) - start` would round differently for each absolute start."""
    done = rec.done[~np.isnan(rec.done)]
    wall = float(done.max() - start) if len(done) else 0.0
    if spec.arrival != "closed":
        wall = max(wall, spec.open_loop_span_s(len(rec.scheduled)))
    return LoadResult(
        spec=spec,
        start=start,
        scheduled=offsets.copy() if offsets is not None else rec.scheduled - start,
        sent=rec.sent - start,
        done=rec.done - start,
        status=rec.status,
        error=rec.error,
        captured=rec.captured,
        wall_s=wall,
        connect_errors=list(client.connect_errors),
        dispatched=rec.dispatched - start,
        interrupted=interrupted,
    )
