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
    """SIGINT presses `stop` while the block runs (when this is the main thread)."""
    try:
        loop.add_signal_handler(signal.SIGINT, stop.press)
    except (ValueError, RuntimeError):  # not the main thread: SIGINT stays its owner's
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGINT)


@contextmanager
def forward_sigint(pids: list[int]) -> Iterator[None]:
    """SIGINT to this process is passed on to the worker processes, which each stop and report
    (a `kill -INT` reaches only this one; Ctrl-C reaches them all, and a second press is a no-op)."""

    def forward(_sig: int, _frame: object) -> None:
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)

    try:
        previous = signal.signal(signal.SIGINT, forward)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def die_with_parent(parent: int) -> None:
    """End this worker process when the process that started it (pid `parent`) ends. Killed or
    terminated (SIGTERM: a CI job's timeout, `timeout 60 toolenv stress`), that one left its
    workers sending for the rest of the run, up to an hour, with no one to report to."""
    with suppress(OSError, AttributeError):  # Linux only
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it was gone before the line above
        os._exit(1)
