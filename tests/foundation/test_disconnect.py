"""`unless_disconnected`: a disconnect ends the work; anything else is left as it was."""

from __future__ import annotations

import asyncio

import pytest

from toolenv_core.disconnect import ClientGone, unless_disconnected


class Client:
    """An ASGI receive past the body: it returns only when the client disconnects."""

    def __init__(self) -> None:
        self.left = asyncio.Event()
        self.waiting = 0

    async def receive(self) -> dict[str, str]:
        self.waiting += 1
        await self.left.wait()
        return {"type": "http.disconnect"}


async def _work(seconds: float, cancelled: list[bool]) -> str:
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        cancelled.append(True)
        raise
    return "answer"


def test_a_disconnect_cancels_the_work_and_says_so() -> None:
    async def main() -> None:
        client, cancelled = Client(), []
        asyncio.get_running_loop().call_later(0.1, client.left.set)
        with pytest.raises(ClientGone):
            await unless_disconnected(_work(30, cancelled), client.receive, watch_after_s=0.02)
        assert cancelled == [True]

    asyncio.run(asyncio.wait_for(main(), 5))


def test_a_short_call_never_watches_and_a_long_one_answers() -> None:
    async def main() -> None:
        client, cancelled = Client(), []
        assert await unless_disconnected(_work(0, cancelled), client.receive, watch_after_s=0.05)
        assert client.waiting == 0  # ended before the watch: no task was made for it
        assert await unless_disconnected(_work(0.1, cancelled), client.receive, watch_after_s=0)
        assert client.waiting == 1 and cancelled == []

    asyncio.run(asyncio.wait_for(main(), 5))


def test_a_cancellation_from_elsewhere_stays_one() -> None:
    """A server's shutdown cancels the request's task: that is not the client leaving."""

    async def main() -> None:
        client, cancelled = Client(), []
        call = asyncio.ensure_future(
            unless_disconnected(_work(30, cancelled), client.receive, watch_after_s=0)
        )
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert cancelled == [True]

    asyncio.run(asyncio.wait_for(main(), 5))
