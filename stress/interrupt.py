"""Ctrl-C during a run ends it early and keeps what it measured (it lost the whole run before).

For a `LoadSpec(interruptible=True)` (what `toolenv stress` runs), the first SIGINT stops sending;
the requests in flight get `GRACE_S` to finish (the rest end as `unfinished`), and the result says
it was interrupted. Only `run_load` in the main thread installs the handler; `arun_load` inside
someone else's loop leaves SIGINT to its owner.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager, suppress
from multiprocessing import resource_tracker
from typing import Any

GRACE_S = 2.0  # how long requests in flight may still finish after Ctrl-C
PR_SET_PDEATHSIG = 1  # prctl(2)


class Stop:
    """Set once Ctrl-C was pressed; awaitable, so a wait can end on it."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def is_set(self) -> bool:
        return self.event.is_set()

    def press(self) -> None:
        self.event.set()


async def until(awaitable: Awaitable[Any], timeout_s: float | None, stop: Stop) -> None:
    """Wait for `awaitable`, at most `timeout_s`, and no longer once Ctrl-C is pressed. The
    awaitable is left running when the wait ends early (the caller decides what to do with it)."""
    if stop.is_set():
        return
    pressed = asyncio.ensure_future(stop.event.wait())
    try:
        await asyncio.wait(
            [asyncio.ensure_future(awaitable), pressed],
            timeout=timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
    finally:
        pressed.cancel()
        with suppress(asyncio.CancelledError):
            await pressed


@contextmanager
def on_sigint(loop: asyncio.AbstractEventLoop, stop: Stop) -> Iterator[None]:
    """SIGINT presses `stop` while the block runs (when this is the main thread); in a worker,
    so does one it was sent before (`hold_sigint`)."""
    try:
        loop.add_signal_handler(signal.SIGINT, stop.press)
    except (ValueError, RuntimeError):  # not the main thread: SIGINT stays its owner's
        yield
        return
    if _held:
        stop.press()
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def send_sigint(pids: list[int]) -> None:
    """SIGINT to each of these processes (those already gone are skipped)."""
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)


@contextmanager
def forward_sigint(pids: list[int]) -> Iterator[list[int]]:
    """SIGINT to this process is passed on to the worker processes, which each stop and report
    (a `kill -INT` reaches only this one; Ctrl-C reaches them all, and a second press is a no-op).
    Yields the presses so far (one item each): a worker not yet spawned at a press missed it."""
    presses: list[int] = []

    def forward(sig: int, _frame: object) -> None:
        presses.append(sig)
        send_sigint(pids)

    try:
        previous = signal.signal(signal.SIGINT, forward)
    except ValueError:  # not the main thread
        yield presses
        return
    try:
        yield presses
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def sigint_blocked_for_children() -> Iterator[None]:
    """Processes spawned in the block start with SIGINT blocked (a signal mask survives fork and
    exec, and the threads a worker's imports start inherit it): a Ctrl-C during their imports was
    a KeyboardInterrupt traceback in each, a broken pipe in the parent, exit 1. It stays pending
    in each until the worker is ready (`hold_sigint`). This process keeps its handler meanwhile
    (`forward_sigint`). It used to ignore SIGINT here (SIG_IGN, which a spawned process also
    inherits), and a Ctrl-C in the block was then lost to everyone, for the whole run: the mask
    held this thread only, numpy's threads took the signal and dropped it, and so did this thread
    once starting multiprocessing's resource tracker had unblocked it (started first here)."""
    resource_tracker.ensure_running()
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)


_held: list[int] = []  # SIGINTs a worker got before its run's handler (`hold_sigint`)


def hold_sigint() -> None:
    """In a worker, once started: a SIGINT is kept for `on_sigint`, which presses its stop; one
    sent while it started (blocked since its spawn) is delivered here."""
    signal.signal(signal.SIGINT, lambda sig, _frame: _held.append(sig))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def die_with_parent(parent: int) -> None:
    """End this worker process when the process that started it (pid `parent`) ends. Killed or
    terminated (SIGTERM: a CI job's timeout, `timeout 60 toolenv stress`), that one left its
    workers sending for the rest of the run, up to an hour, with no one to report to."""
    with suppress(OSError, AttributeError):  # Linux only
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it was gone before the line above
        os._exit(1)
