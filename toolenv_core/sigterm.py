"""SIGTERM unwinds an asyncio command as Ctrl-C does, then ends it by SIGTERM all the same.

Why: SIGTERM (`timeout`, `kill PID`, a CI cancel) ends a Python process where it stands, its
`finally` blocks skipped. `toolenv rollout run --engine vllm` left vLLM's engine-core and worker
processes running (2.6 GB, still busy) and its fresh output directory behind, where Ctrl-C,
which `asyncio.run` turns into a cancellation of the main task, had closed the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import Awaitable, Iterator
from typing import TypeVar

T = TypeVar("T")


class Terminated(BaseException):
    """The command's main task was cancelled by SIGTERM (its `finally` blocks have run)."""


async def sigterm_cancels(main: Awaitable[T]) -> T:
    """Await `main` in the running loop's main task; SIGTERM cancels that task (as asyncio's own
    Ctrl-C handler does) and the cancellation comes out as `Terminated`. The handler before it is
    back afterwards (the loop's own removal set SIG_DFL: a study's second cell and its report
    were then ended where they stood). Outside the main thread SIGTERM is left to its owner."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    terminated = False
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm() -> None:
        nonlocal terminated
        terminated = True
        if task is not None:
            task.cancel()

    try:
        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    except (ValueError, RuntimeError, NotImplementedError):  # not the main thread
        return await main
    try:
        return await main
    except asyncio.CancelledError:
        if terminated:
            raise Terminated from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        if previous is not None:  # None: set outside Python, nothing to put back
            signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def ends_by_sigterm() -> Iterator[None]:
    """Around a command: once `Terminated` has unwound it (the blocks inside cleaned up), the
    process ends by SIGTERM, as it would have without the handler (exit status 143 to a shell)."""
    try:
        yield
    except Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise SystemExit(128 + signal.SIGTERM) from None  # if the signal is blocked meanwhile


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Around a command without an event loop: SIGTERM raises `Terminated` where the main thread
    stands, so the blocks inside unwind as on Ctrl-C (a download's part file, a fresh output
    directory removed), then the process ends by SIGTERM all the same. Outside the main thread
    SIGTERM is left to its owner."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return

    def terminated(_signum: int, _frame: object) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        with ends_by_sigterm():
            yield
    finally:
        signal.signal(signal.SIGTERM, previous)
