"""Two sandboxd instances over one parent cgroup with the same pid: replicas of a compose service
(`docker compose up --scale sandbox=2`) each run sandboxd as pid 7 over the project's delegated
subtree. Two pools in this one process stand in for them. Each must keep cgroups of its own, and
one stopping must leave the other's running programs and slots alone.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator

import pytest

from sandboxd.process.cgroups import PREFIX, CgroupPool


@pytest.fixture
def pool() -> Iterator[CgroupPool]:
    first = CgroupPool(size=2)
    first.start()
    if not first.available:
        pytest.skip(f"no cgroup v1 pool here: {first.unavailable_reason}")
    yield first
    asyncio.run(first.close())


async def test_an_instance_with_the_same_pid_keeps_its_own_cgroups(pool: CgroupPool) -> None:
    slot = pool.acquire()
    assert slot is not None
    program = subprocess.Popen(["sleep", "30"])
    try:
        slot.attach(program.pid)
        sibling = CgroupPool(size=2)
        sibling.start()
        assert sibling.available, sibling.unavailable_reason
        assert set(sibling.bases.values()).isdisjoint(pool.bases.values())
        assert sibling.bases["pids"].name == f"{PREFIX}{os.getpid()}-1"
        await sibling.close()  # the replica stops
        assert program.poll() is None, "the sibling's stop killed this instance's program"
        assert slot.task_count() == 1
        assert all(d.is_dir() for d in slot.dirs.values())
    finally:
        program.kill()
        program.wait()


def test_a_dead_siblings_cgroups_with_this_pid_are_reaped(pool: CgroupPool) -> None:
    """A replica that was killed left its dirs, named with the pid every replica has: no one
    holds them, so the next instance to start removes them; the live instance's are kept."""
    parent = pool.bases["pids"].parent
    left = parent / f"{PREFIX}{os.getpid()}-3"
    (left / "run-1").mkdir(parents=True)
    try:
        later = CgroupPool(size=1)
        later.start()
        asyncio.run(later.close())
        assert not left.exists()
        assert pool.bases["pids"].is_dir()
    finally:
        for d in (left / "run-1", left):
            if d.exists():
                d.rmdir()
