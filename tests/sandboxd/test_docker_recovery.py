"""The docker backend's pool under trouble, on real containers: runs waiting for a container,
admission held to the pool, a cancelled run, containers killed from outside or while idle."""

from __future__ import annotations

import asyncio
import time

import docker
import pytest
from docker_support import labelled, run

from sandboxd.docker_backend import DockerBackend
from sandboxd.models import ExecStatus, RunResult, RunSpec
from sandboxd.service import SandboxService
from sandboxd.settings import SandboxSettings
from sandboxd.wire import RunCodeRequest
from toolenv_core.admission import ExpiredInQueue
from toolenv_core.deadline import Deadline

pytestmark = pytest.mark.docker


def test_runs_wait_for_a_container_bounded_by_their_deadline(portal, image: str) -> None:
    b = DockerBackend(
        SandboxSettings(docker_image=image, docker_pool_size=1, docker_max_runs_per_container=3)
    )
    portal.call(b.start)
    try:
        first = b.status()["created"]

        async def crowd() -> tuple[RunResult, Exception | None, RunResult]:
            slow = asyncio.create_task(
                b.run(
                    RunSpec(language="python", code="import time; time.sleep(1.5)"),
                    Deadline.after(20),
                )
            )
            await asyncio.sleep(0.2)
            short_err: Exception | None = None
            t0 = time.monotonic()
            try:
                await b.run(RunSpec(language="python", code="print(1)"), Deadline.after(0.3))
            except ExpiredInQueue as exc:  # the service answers it as the deadline's TLE
                short_err = exc
                assert time.monotonic() - t0 < 1.0
            patient = await b.run(RunSpec(language="python", code="print(2)"), Deadline.after(20))
            return await slow, short_err, patient

        slow, short_err, patient = portal.call(crowd)
        assert slow.run.status == ExecStatus.FINISHED
        assert isinstance(short_err, ExpiredInQueue) and "deadline" in str(short_err)
        assert patient.run.stdout == "2\n" and patient.sandbox_id == slow.sandbox_id
        # third run on that container: it is recycled after it, so the fourth gets a new one
        third = run(portal, b, RunSpec(language="python", code="print(3)"))
        fourth = run(portal, b, RunSpec(language="python", code="print(4)"))
        assert third.sandbox_id == slow.sandbox_id and fourth.sandbox_id != slow.sandbox_id
        assert b.status()["created"] == first + 1 and b.status()["recycled"] == 1
    finally:
        pool_id = b.pool.pool_id
        portal.call(b.close)
    assert labelled(f"toolenv.pool={pool_id}") == []


def test_admission_holds_what_the_pool_cannot_run(portal, image: str) -> None:
    """Admission sized from the host (8 on 2 cores) over a pool of 1: a second call was
    admitted and waited inside the pool for the container, past the queue's bounds
    (`queue_timeout_s`, `queue_size`), while the status said no call waited."""
    service = SandboxService(
        SandboxSettings(backend="docker", docker_image=image, docker_pool_size=1)
    )
    portal.call(service.start)
    try:
        assert service.status()["admission"]["capacity"] == 1
        sleeper = RunCodeRequest(code="import time; time.sleep(2)", language="python")
        first = portal.start_task_soon(service.run_code, sleeper, Deadline.after(60))
        end = time.monotonic() + 30
        while service.status()["admission"]["running"] < 1 and time.monotonic() < end:
            time.sleep(0.02)
        quick = RunCodeRequest(code="print(7)", language="python")
        second = portal.start_task_soon(service.run_code, quick, Deadline.after(60))
        while time.monotonic() < end:
            status = service.status()
            if status["admission"]["waiting"] or status["waiting"]:
                break
            time.sleep(0.02)
        assert (status["admission"]["waiting"], status["waiting"]) == (1, 0), status
        assert "all 1 program slots are in flight" in status["admission"]["waits_because"]
        assert "docker_pool_size" in status["admission"]["limit_from"]
        assert first.result(30).status == "Success"
        assert second.result(30).run_result.stdout == "7\n"
    finally:
        pool_id = service.backend.pool.pool_id
        portal.call(service.close)
    assert labelled(f"toolenv.pool={pool_id}") == []


def test_cancelled_run_destroys_its_container(portal, backend) -> None:
    """A caller that gives up (cancelled scope) leaves no program running: the container goes."""

    async def cancel_midway() -> str:
        before = set(backend.pool._live)
        task = asyncio.create_task(
            backend.run(
                RunSpec(language="python", code="import time; time.sleep(30)"), Deadline.after(60)
            )
        )
        await asyncio.sleep(0.5)
        busy = set(backend.pool._live) - {c.id for c in backend.pool._idle}
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        (victim,) = busy & before
        return victim

    victim = portal.call(cancel_midway)
    client = docker.from_env()
    end = time.monotonic() + 20
    while client.api.containers(all=True, filters={"id": victim}) and time.monotonic() < end:
        time.sleep(0.1)
    assert not client.api.containers(all=True, filters={"id": victim})
    while backend.status()["live"] < 2 and time.monotonic() < end:
        time.sleep(0.1)
    assert backend.status()["live"] == 2  # replaced in the background


def test_container_killed_from_outside_is_replaced_and_the_run_retried(portal, backend) -> None:
    client = docker.from_env()
    end = time.monotonic() + 20
    while len(backend.pool._idle) < 2 and time.monotonic() < end:
        time.sleep(0.05)
    victim = backend.pool._idle[0]  # the next run takes this one
    client.api.kill(victim.id)
    r = run(portal, backend, RunSpec(language="python", code="print('still here')"))
    assert r.run.status == ExecStatus.FINISHED and r.run.stdout == "still here\n"
    assert r.sandbox_id != victim.name
    while backend.status()["live"] < 2 and time.monotonic() < end:
        time.sleep(0.1)
    assert victim.id not in backend.pool._live and backend.status()["live"] == 2


def test_containers_that_died_while_idle_cost_no_run(portal, backend) -> None:
    """An engine restart kills every idle container at once: the pool sees each one's agent hung
    up as it takes it, so the next runs get fresh containers (each run was retried once only:
    with every container dead, a pool of N failed N/2 runs)."""
    client = docker.from_env()
    end = time.monotonic() + 20
    while len(backend.pool._idle) < 2 and time.monotonic() < end:
        time.sleep(0.05)
    victims = list(backend.pool._idle)
    assert len(victims) == 2
    for victim in victims:
        client.api.kill(victim.id)
    while time.monotonic() < end:
        if all(not client.api.containers(filters={"id": v.id}) for v in victims):
            break
        time.sleep(0.05)
    time.sleep(0.2)  # the hang-ups reach the pool's connections
    for _ in range(2):
        r = run(portal, backend, RunSpec(language="python", code="print('fresh')"))
        assert r.run is not None and r.run.stdout == "fresh\n", r
        assert r.sandbox_id not in {v.name for v in victims}
    while backend.status()["live"] < 2 and time.monotonic() < end:
        time.sleep(0.1)
    assert backend.status()["live"] == 2
    assert not {v.id for v in victims} & set(backend.pool._live)
