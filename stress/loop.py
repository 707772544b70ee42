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
import multiprocessing as mp
import os
import resource
import time
from multiprocessing.connection import wait as wait_any
from typing import Any

import numpy as np
import uvloop

from toolenv_core.http1 import ERR_DROPPED, Endpoint
from toolenv_core.timer import sleep_until

from .http import LoadClient, Recorder, encode_body, encode_request
from .interrupt import (
    GRACE_S,
    Stop,
    die_with_parent,
    forward_sigint,
    hold_sigint,
    on_sigint,
    send_sigint,
    sigint_ignored_by_children,
    until,
)
from .result import LoadResult
from .spec import LoadSpec, Progress, schedule_offsets
from .targets import check_loopback


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
        return _run_workers(spec)
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
    await client.preconnect(warm)
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
            await until(finished, spec.duration_s + spec.timeout_s + 1.0, stop)
        await client.drain(GRACE_S if stop.is_set() else 0.0)
    finally:
        await client.aclose()
        await ticker.stop()
    _trim(rec, next_rid)
    return _result(spec, rec, start, client, interrupted=stop.is_set())


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


# ------------------------------------------------------------------------------ workers


def _worker_main(
    spec: LoadSpec, index: int, conn: Any, forward_progress: bool = False, parent: int = 0
) -> None:
    """Runs in a spawned process: wait for the common start instant, run, send arrays back
    (and, for a live display, each progress snapshot as it comes)."""
    if parent:
        die_with_parent(parent)
    try:
        if spec.interruptible:
            hold_sigint()
        conn.send("ready")
        start_at = conn.recv()
        spec.start_at = start_at
        if forward_progress:
            spec.progress = conn.send
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
                result.interrupted,
            )
        )
    except BaseException as exc:  # report, never hang the parent
        conn.send(exc)
    finally:
        conn.close()


def _gather(pipes: list[Any], spec: LoadSpec) -> list[Any]:
    """Each worker's arrays, in worker order; its progress snapshots on the way are merged into
    `spec.progress` (the live display read "starting ..." for a whole run with workers)."""
    parts: list[Any] = [None] * len(pipes)
    pending = dict(enumerate(pipes))
    latest: dict[int, Progress] = {}
    while pending:
        for pipe in wait_any(list(pending.values())):
            w = pipes.index(pipe)
            got = pipe.recv()
            if isinstance(got, BaseException):
                raise got
            if isinstance(got, Progress):
                latest[w] = got
                if spec.progress is not None:
                    spec.progress(Progress.merge(list(latest.values())))
                continue
            parts[w] = got
            del pending[w]
    return parts


def _run_workers(spec: LoadSpec) -> LoadResult:
    """Split an open-loop rate over `spec.workers` processes, interleaved, and merge."""
    endpoint = Endpoint.parse(spec.url)
    check_loopback(endpoint.host, allow_remote=spec.allow_remote)
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    pipes: list[Any] = []
    pids: list[int] = []  # the workers a Ctrl-C is passed on to, each as it starts
    if not spec.interruptible:  # Ctrl-C is the caller's: a KeyboardInterrupt everywhere
        _spawn(spec, ctx, procs, pipes, pids)
        return _start_and_merge(spec, procs, pipes, [])
    with forward_sigint(pids) as presses:
        with sigint_ignored_by_children():
            _spawn(spec, ctx, procs, pipes, pids)
        return _start_and_merge(spec, procs, pipes, presses)


def _spawn(spec: LoadSpec, ctx: Any, procs: list[Any], pipes: list[Any], pids: list[int]) -> None:
    k = spec.workers
    for w in range(k):
        sub = LoadSpec(
            **{
                **{f: getattr(spec, f) for f in LoadSpec.__dataclass_fields__},
                "rate": spec.rate / k,
                "max_requests": spec.worker_cap(w),
                "max_in_flight": max(1, spec.max_in_flight // k),
                "connections": max(1, spec.max_connections() // k),
                "workers": 1,
                "seed": None if spec.seed is None else spec.seed * 1000 + w,
                "progress": None,
            }
        )
        parent, child = ctx.Pipe()
        forward = spec.progress is not None
        p = ctx.Process(
            target=_worker_main, args=(sub, w, child, forward, os.getpid()), daemon=True
        )
        p.start()
        procs.append(p)
        pipes.append(parent)
        if p.pid is not None:
            pids.append(p.pid)


def _start_and_merge(
    spec: LoadSpec, procs: list[Any], pipes: list[Any], presses: list[int]
) -> LoadResult:
    """Wait until every worker is ready, give them one start instant, merge what they send."""
    k = spec.workers
    try:
        for pipe in pipes:  # imported, SIGINT held for its run's handler (`hold_sigint`)
            if not isinstance(got := pipe.recv(), str):
                raise got
        start = time.monotonic() + 0.3 + 0.01 * k  # their preconnects before the clock
        for w, pipe in enumerate(pipes):
            # constant rate: shift worker w by w/rate so the merged stream is evenly spaced
            shift = w / spec.rate if spec.arrival == "constant" else 0.0
            pipe.send(start + shift)
        if presses:  # Ctrl-C while they started, which they ignored: theirs now, before a send
            send_sigint([p.pid for p in procs])
        parts = _gather(pipes, spec)
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
    wall = max(float(finite.max()) if len(finite) else 0.0, spec.open_loop_span_s(len(done)))
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
        connect_errors=list(dict.fromkeys(e for p in parts for e in p[6]))[:5],
        dispatched=dispatched[order],
        interrupted=any(p[8] for p in parts),
    )
