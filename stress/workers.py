"""Open-loop runs over several generator processes (`LoadSpec.workers`): each runs its share of
the schedule in its own process (its own loop and connections), all from one start instant, and
their records are merged as one run's. Ctrl-C reaches every worker, even one still starting.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from multiprocessing.connection import wait as wait_any
from typing import Any

import numpy as np

from toolenv_core.http1 import Endpoint

from .interrupt import (
    die_with_parent,
    forward_sigint,
    hold_sigint,
    send_sigint,
    sigint_blocked_for_children,
)
from .result import LoadResult
from .spec import LoadSpec, Progress
from .targets import check_loopback


def _worker_main(
    spec: LoadSpec,
    run_one: Callable[[LoadSpec], LoadResult],
    conn: Any,
    forward_progress: bool = False,
    parent: int = 0,
) -> None:
    """Runs in a spawned process: wait for the common start instant, run (`run_one`, the
    single-process `run_load`), send arrays back (and, for a live display, each progress
    snapshot as it comes)."""
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
        result = run_one(spec)
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


def run_workers(spec: LoadSpec, run_one: Callable[[LoadSpec], LoadResult]) -> LoadResult:
    """Split an open-loop rate over `spec.workers` processes, interleaved, and merge; each runs
    its share with `run_one` (passed in, by reference: the loop module imports this one)."""
    endpoint = Endpoint.parse(spec.url)
    check_loopback(endpoint.host, allow_remote=spec.allow_remote)
    ctx = mp.get_context("spawn")
    procs: list[Any] = []
    pipes: list[Any] = []
    pids: list[int] = []  # the workers a Ctrl-C is passed on to, each as it starts
    if not spec.interruptible:  # Ctrl-C is the caller's: a KeyboardInterrupt everywhere
        _spawn(spec, run_one, ctx, procs, pipes, pids)
        return _start_and_merge(spec, procs, pipes, [])
    with forward_sigint(pids) as presses:
        with sigint_blocked_for_children():
            _spawn(spec, run_one, ctx, procs, pipes, pids)
        return _start_and_merge(spec, procs, pipes, presses)


def _spawn(
    spec: LoadSpec,
    run_one: Callable[[LoadSpec], LoadResult],
    ctx: Any,
    procs: list[Any],
    pipes: list[Any],
    pids: list[int],
) -> None:
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
            target=_worker_main, args=(sub, run_one, child, forward, os.getpid()), daemon=True
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
        if presses:  # Ctrl-C while they started: to each again (one not yet spawned then missed it)
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
