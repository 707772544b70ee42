"""Unit test of the pool's hand-off of free containers to waiting runs (no engine needed: the
containers are stand-ins; the docker parts are covered by the other test_docker_* modules)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from sandboxd.docker_backend.pool import ContainerPool
from sandboxd.settings import SandboxSettings
from toolenv_core.admission import ExpiredInQueue
from toolenv_core.deadline import Deadline


@dataclass
class LiveConnection:
    closed: bool = False


@dataclass
class StandIn:
    id: str
    runs: int = 0
    conn: LiveConnection = field(default_factory=LiveConnection)


def pool_with(*ids: str) -> ContainerPool:
    pool = ContainerPool(SandboxSettings(docker_pool_size=len(ids) or 1), client=None)  # type: ignore[arg-type]
    for i in ids:
        pool._live[i] = StandIn(i)  # type: ignore[assignment]
    return pool


async def test_waiters_are_served_first_come_first_served() -> None:
    pool = pool_with("x", "y", "z")
    order: list[tuple[str, str]] = []

    async def take(name: str) -> None:
        c = await pool.acquire(Deadline.after(5))
        order.append((name, c.id))

    tasks = []
    for name in ("a", "b", "c"):
        tasks.append(asyncio.create_task(take(name)))
        await asyncio.sleep(0)  # a queues before b, b before c
    assert pool.status()["waiting"] == 3
    for cid in ("x", "y", "z"):
        pool.release(pool._live[cid])
    await asyncio.gather(*tasks)
    assert order == [("a", "x"), ("b", "y"), ("c", "z")]


async def test_a_newcomer_does_not_overtake_a_waiter() -> None:
    pool = pool_with("x")
    waiter = asyncio.create_task(pool.acquire(Deadline.after(5)))
    await asyncio.sleep(0)
    pool.release(pool._live["x"])  # handed to the waiter, not left in the idle queue
    with pytest.raises(ExpiredInQueue, match="deadline"):
        await pool.acquire(Deadline.after(0.2))  # asks before the waiter has even resumed
    assert (await waiter).id == "x"


async def test_a_container_handed_to_a_run_that_gave_up_is_passed_on() -> None:
    pool = pool_with("x")
    quitter = asyncio.create_task(pool.acquire(Deadline.after(5)))
    patient = asyncio.create_task(pool.acquire(Deadline.after(5)))
    await asyncio.sleep(0)
    pool.release(pool._live["x"])  # the quitter's future now holds "x" ...
    quitter.cancel()  # ... but it is cancelled before it resumes
    with pytest.raises(asyncio.CancelledError):
        await quitter
    assert (await patient).id == "x"
    assert pool.status()["waiting"] == 0


async def test_discarded_containers_are_never_handed_out() -> None:
    pool = pool_with("x", "y")
    pool._idle.extend([pool._live["x"], pool._live["y"]])
    del pool._live["x"]  # destroyed while it sat in the idle queue
    assert (await pool.acquire(Deadline.after(1))).id == "y"
