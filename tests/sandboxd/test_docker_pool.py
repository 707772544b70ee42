"""Docker backend life cycle: the image build is idempotent, a crashed instance's containers are
reaped at the next start-up, a live instance's are not, and close() leaves nothing behind."""

from __future__ import annotations

import asyncio
import fcntl
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import docker
import pytest
import requests
from anyio.from_thread import BlockingPortal
from docker_support import labelled

from sandboxd.backend import SandboxUnavailable
from sandboxd.docker_backend import DockerBackend
from sandboxd.docker_backend.image import HASH_LABEL, ensure_image, image_is_current, source_hash
from sandboxd.docker_backend.pool import default_state_dir
from sandboxd.models import RunSpec
from sandboxd.settings import SandboxSettings
from toolenv_core.admission import ExpiredInQueue
from toolenv_core.deadline import Deadline

pytestmark = pytest.mark.docker
REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "scripts/build_sandbox_image.sh"


def test_image_build_is_idempotent_and_hash_agrees(image: str, base_image: str) -> None:
    client = docker.from_env()
    before = client.images.get(image)
    assert before.labels[HASH_LABEL] == source_hash()  # the script and the Python helper agree
    env = {**os.environ, "TOOLENV_BASE_IMAGE": base_image, "TOOLENV_SANDBOX_DOCKER_IMAGE": image}
    out = subprocess.run([str(BUILD)], env=env, capture_output=True, text=True, check=True)
    assert out.stdout == ""  # nothing built
    assert client.images.get(image).id == before.id
    assert image_is_current(client, image)
    assert ensure_image(client, image, base_image) is False


def test_backend_builds_a_missing_image(base_image: str) -> None:
    client = docker.from_env()
    tag = "toolenv/sandbox:test-autobuild"
    try:
        client.images.remove(tag, force=True)
    except docker.errors.ImageNotFound:
        pass
    try:
        assert not image_is_current(client, tag)
        assert ensure_image(client, tag, base_image) is True
        assert image_is_current(client, tag)
    finally:
        client.images.remove(tag, force=True)


CRASHER = textwrap.dedent(
    """
    import asyncio, os, sys
    from sandboxd.docker_backend import DockerBackend
    from sandboxd.settings import SandboxSettings

    async def main():
        b = DockerBackend(SandboxSettings(docker_image=sys.argv[1], docker_pool_size=2))
        await b.start()
        print(b.pool.pool_id, flush=True)
        os._exit(3)  # die without close(), like a SIGKILLed service

    asyncio.run(main())
    """
)


def test_crashed_instance_containers_are_reaped_live_ones_kept(
    portal: BlockingPortal, image: str
) -> None:
    client = docker.from_env()
    crashed = subprocess.run(
        [sys.executable, "-c", CRASHER, image],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert crashed.returncode == 3, crashed.stderr
    dead_pool = crashed.stdout.strip()
    assert len(labelled(f"toolenv.pool={dead_pool}")) == 2  # left behind by the crash

    # a container of a *live* instance: its lock is held (here by this test)
    state = default_state_dir()
    live_lock = state / "livepool0test.lock"
    fd = os.open(live_lock, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    live = client.containers.run(
        image,
        command=["sleep", "300"],
        detach=True,
        network_mode="none",
        labels={
            "toolenv.sandbox": "1",
            "toolenv.pool": "livepool0test",
            "toolenv.lock": str(live_lock),
        },
    )
    stale_lock = state / "stalepool0test.lock"  # a dead instance whose containers are gone
    stale_lock.touch()
    (state / "stalepool0test").mkdir(exist_ok=True)
    b = DockerBackend(SandboxSettings(docker_image=image, docker_pool_size=1))
    try:
        portal.call(b.start)
        assert not stale_lock.exists() and not (state / "stalepool0test").exists()
        assert live_lock.exists()
        assert labelled(f"toolenv.pool={dead_pool}") == []
        assert not (state / dead_pool).exists() and not (state / f"{dead_pool}.lock").exists()
        assert b.status()["reaped_at_start"] == 2
        assert live.id[:12] in labelled("toolenv.pool=livepool0test")
        r = portal.call(b.run, RunSpec(language="python", code="print(7)"), Deadline.after(30))
        assert r.run.stdout == "7\n"
    finally:
        pool_id = b.pool.pool_id if b.pool else "none"
        portal.call(b.close)
        live.remove(force=True)
        os.close(fd)
        live_lock.unlink()
    assert labelled(f"toolenv.pool={pool_id}") == []
    assert not (state / pool_id).exists() and not (state / f"{pool_id}.lock").exists()


def test_close_during_refill_leaves_nothing(portal: BlockingPortal, image: str) -> None:
    """close() right after start-up work began: containers being created are removed too."""
    b = DockerBackend(SandboxSettings(docker_image=image, docker_pool_size=2))
    portal.call(b.start)
    pool = b.pool
    portal.call(
        lambda: [pool.discard(c, "test: force a refill") for c in list(pool._live.values())]
    )
    assert pool.status()["refilling"] >= 1
    portal.call(b.close)
    deadline = time.monotonic() + 10
    while labelled(f"toolenv.pool={pool.pool_id}") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert labelled(f"toolenv.pool={pool.pool_id}") == []


def test_runs_waiting_when_no_container_can_start_fail_instead_of_hanging(
    portal: BlockingPortal, image: str
) -> None:
    """No container live and none can start (its image was removed): a run without a deadline
    (SandboxFusion's clients send none) waited for a container forever; it fails, saying why."""
    b = DockerBackend(SandboxSettings(docker_image=image, docker_pool_size=1))
    portal.call(b.start)
    try:
        pool = b.pool
        b.settings.docker_image = "toolenv/sandbox-missing:none"  # every new start fails

        async def run_after_losing_the_container() -> None:
            for c in list(pool._live.values()):
                pool.discard(c, "test: the container is gone")
            spec = RunSpec(language="python", code="print(1)")
            await asyncio.wait_for(b.run(spec, Deadline.never()), 120)

        with pytest.raises(SandboxUnavailable, match="none could start"):
            portal.call(run_after_losing_the_container)
        assert pool.status()["waiting"] == 0
    finally:
        pool_id = b.pool.pool_id if b.pool else "none"
        portal.call(b.close)
    assert labelled(f"toolenv.pool={pool_id}") == []


def test_a_deadline_that_ends_a_wait_for_a_container_is_a_time_limit(
    portal: BlockingPortal, image: str
) -> None:
    """Every container busy (admission lets in no more runs than the pool holds, but a container
    being replaced leaves fewer): a run whose deadline ends while it waits for one is the
    deadline's (ExpiredInQueue, answered TimeLimitExceeded), not an unavailable sandbox."""
    b = DockerBackend(SandboxSettings(docker_image=image, docker_pool_size=1))
    portal.call(b.start)
    try:
        pool = b.pool
        held = portal.call(pool.acquire, Deadline.never())
        spec = RunSpec(language="python", code="print(1)")
        with pytest.raises(ExpiredInQueue, match="no sandbox container became free before the"):
            portal.call(b.run, spec, Deadline.after(0.5))
        assert pool.status()["waiting"] == 0
        portal.call(pool.release, held)
        result = portal.call(b.run, spec, Deadline.after(30))
        assert result.run is not None and result.run.stdout == "1\n"
    finally:
        pool_id = b.pool.pool_id if b.pool else "none"
        portal.call(b.close)
    assert labelled(f"toolenv.pool={pool_id}") == []


class FlakyRemoval:
    """Stands in for an engine that cannot be reached (restarting) while `down`: removing a
    container fails as the docker SDK does then (requests' ConnectionError)."""

    def __init__(self, backend: DockerBackend) -> None:
        self.real = backend._client.api.remove_container
        self.down = True
        backend._client.api.remove_container = self  # type: ignore[method-assign]

    def __call__(self, *args: object, **kwargs: object) -> object:
        if self.down:
            raise requests.exceptions.ConnectionError("('Connection aborted.', refused)")
        return self.real(*args, **kwargs)


def test_a_container_the_engine_could_not_remove_is_removed_once_it_answers(
    portal: BlockingPortal, image: str
) -> None:
    """A container discarded while the engine is unreachable (it restarts) is removed once it
    answers again: its removal failed once, with a traceback, and was never tried again."""
    b = DockerBackend(SandboxSettings(docker_image=image, docker_pool_size=1))
    portal.call(b.start)
    try:
        pool = b.pool
        engine = FlakyRemoval(b)
        (victim,) = list(pool._live.values())
        docker.from_env().api.kill(victim.id)  # dies with the engine
        time.sleep(0.3)
        r = portal.call(b.run, RunSpec(language="python", code="print(2)"), Deadline.after(30))
        assert r.run is not None and r.run.stdout == "2\n"
        time.sleep(1.5)
        assert victim.id[:12] in labelled(f"toolenv.pool={pool.pool_id}")  # not removable yet
        engine.down = False
        gone_by = time.monotonic() + 5
        while victim.id[:12] in labelled(f"toolenv.pool={pool.pool_id}"):
            assert time.monotonic() < gone_by, "the container was never removed"
            time.sleep(0.1)
    finally:
        pool_id = b.pool.pool_id if b.pool else "none"
        portal.call(b.close)
    assert labelled(f"toolenv.pool={pool_id}") == []


def test_close_while_the_engine_is_unreachable_leaves_the_rest_to_the_next_start(
    portal: BlockingPortal, image: str
) -> None:
    """close() with the engine unreachable: no exception (the app's shutdown failed with a
    traceback), the socket dir and the lock are gone, and the next start reaps the containers."""
    b = DockerBackend(SandboxSettings(docker_image=image, docker_pool_size=1))
    portal.call(b.start)
    pool = b.pool
    FlakyRemoval(b)
    try:
        portal.call(b.close)
        assert not pool.dir.exists() and not pool.lock_path.exists()
        left = labelled(f"toolenv.pool={pool.pool_id}")
        assert len(left) == 1
    finally:
        after = DockerBackend(SandboxSettings(docker_image=image, docker_pool_size=1))
        portal.call(after.start)
        portal.call(after.close)
    assert labelled(f"toolenv.pool={pool.pool_id}") == []
    assert after.pool is not None and after.pool.status()["reaped_at_start"] == 1
