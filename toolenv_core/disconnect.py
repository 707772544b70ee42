"""A request's work, stopped when its client disconnects.

ASGI servers (uvicorn) do not cancel a request's task when its client leaves: the work would go
on for an answer no one reads (a sandboxed program to its time limit, holding its slot). Past the
request's body the next `receive()` returns only at the disconnect, so a watcher awaits it and
cancels the request's task; the work unwinds as any cancelled call does.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")
Receive = Callable[[], Awaitable[Mapping[str, Any]]]

# Request tasks cancelled because their client left (by `cancel_for_caller`): any other
# cancellation of a request (uvicorn's at the end of its shutdown grace) is the server's.
_LEFT_BY_CALLER: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()


class ClientGone(Exception):
    """The client disconnected before its answer: no one is left to read it."""


def cancel_for_caller(task: asyncio.Task[Any]) -> None:
    """Cancel a request's task because its client left, marked so (`caller_left`)."""
    _LEFT_BY_CALLER.add(task)
    task.cancel()


def caller_left() -> bool:
    """Whether the running task's cancellation is its client's leaving (not the server's)."""
    return asyncio.current_task() in _LEFT_BY_CALLER


async def unless_disconnected(work: Awaitable[T], receive: Receive, *, watch_after_s: float) -> T:
    """`work`'s result, or `ClientGone` once the client disconnects first.

    The watcher starts `watch_after_s` into the call: a shorter call just ends (a task per call
    cost short sandbox runs a few percent of their throughput). Only a cancellation of ours
    becomes `ClientGone`; a shutdown's stays a cancellation."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    gone = False
    watcher: asyncio.Task[None] | None = None

    async def watch() -> None:
        nonlocal gone
        if (await receive())["type"] == "http.disconnect":
            gone = True
            cancel_for_caller(task)

    def arm() -> None:
        nonlocal watcher
        watcher = loop.create_task(watch())

    timer = loop.call_later(watch_after_s, arm)
    try:
        return await work
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:
            raise ClientGone from None
        raise
    finally:
        timer.cancel()
        if watcher is not None:  # no await since `work` ended: it cannot have fired after it
            watcher.cancel()
