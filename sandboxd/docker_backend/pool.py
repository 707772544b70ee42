"""The warm pool: N ready containers, refilled in the background, leftovers of dead instances reaped.

Each pool instance holds an exclusive `flock` on `<state_dir>/<pool id>.lock` for its lifetime
and labels its containers with that path. At start-up a labelled container whose lock can be
taken (or whose lock file is gone) belongs to an instance that died without cleaning up, and is
removed; containers of live instances (lock held) are left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import docker
import docker.errors

from toolenv_core.admission import ExpiredInQueue
from toolenv_core.deadline import Deadline

from ..backend import SandboxUnavailable
from ..settings import SandboxSettings
from .container import (
    LABEL,
    LOCK_LABEL,
    POOL_LABEL,
    SandboxContainer,
    create_container,
    remove_container,
    remove_container_sync,
)

log = logging.getLogger(__name__)
RETRY_PAUSE_S = 1.0


def default_state_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/run/toolenv-sandboxd")
    return Path(tempfile.gettempdir()) / f"toolenv-sandboxd-{os.geteuid()}"


def reap_leftovers(client: docker.DockerClient, own_pool: str | None = None) -> list[str]:
    """Remove labelled containers whose owning instance is dead; return their names. Blocking."""
    removed: list[str] = []
    containers = client.containers.list(all=True, filters={"label": f"{LABEL}=1"})
    alive: dict[str, bool] = {}
    for c in containers:
        pool = c.labels.get(POOL_LABEL, "")
        if pool == own_pool:
            continue
        lock = c.labels.get(LOCK_LABEL, "")
        if lock not in alive:
            alive[lock] = _lock_is_held(lock)
        if alive[lock]:
            continue
        remove_container_sync(client, c.id)
        removed.append(c.name)
        if lock:
            shutil.rmtree(Path(lock).with_suffix(""), ignore_errors=True)
            with contextlib.suppress(OSError):
                os.unlink(lock)
    return removed


def sweep_stale_state(state_dir: Path, own_pool: str) -> None:
    """Drop socket dirs and locks of dead instances whose containers are already gone."""
    for lock in state_dir.glob("*.lock"):
        if lock.stem != own_pool and not _lock_is_held(str(lock)):
            shutil.rmtree(state_dir / lock.stem, ignore_errors=True)
            with contextlib.suppress(OSError):
                lock.unlink()


def _lock_is_held(path: str) -> bool:
    if not path:
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False  # lock file gone: its owner has cleaned up or the machine rebooted
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the lock we may have just taken
    return False


class ContainerPool:
    """Warm containers ready for one run each; the caller returns them through `release`."""

    def __init__(self, settings: SandboxSettings, client: docker.DockerClient) -> None:
        self.settings = settings
        self.client = client
        self.pool_id = secrets.token_hex(6)
        self.state_dir = Path(settings.docker_state_dir or default_state_dir())
        self.lock_path = self.state_dir / f"{self.pool_id}.lock"
        self.dir = self.state_dir / self.pool_id
        self._lock_fd: int | None = None
        self._idle: deque[SandboxContainer] = deque()
        self._waiters: deque[asyncio.Future[SandboxContainer]] = deque()
        self._live: dict[str, SandboxContainer] = {}
        self._starting = 0
        self._serial = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._retry_at = 0.0
        self.created = 0
        self.recycled = 0
        self.failures = 0
        self.reaped: list[str] = []
        self.last_error: str | None = None

    # ------------------------------------------------------------ life cycle

    async def start(self) -> None:
        """Take the lock, reap dead instances' containers, and fill the pool (all of it)."""
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # lock first, then publish the name: no other instance ever sees it unlocked
        tmp = self.lock_path.with_suffix(".tmp")
        self._lock_fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, self.lock_path)
        self.dir.mkdir(mode=0o700)
        self.reaped = await asyncio.to_thread(reap_leftovers, self.client, self.pool_id)
        sweep_stale_state(self.state_dir, self.pool_id)
        if self.reaped:
            log.warning("removed %d containers left by a dead instance", len(self.reaped))
        self._refill()
        deadline = time.monotonic() + self.settings.docker_start_timeout_s
        while len(self._idle) < self.settings.docker_pool_size:
            if time.monotonic() > deadline:
                raise SandboxUnavailable(
                    f"the docker pool did not warm up in {self.settings.docker_start_timeout_s} s"
                    f" ({len(self._idle)} of {self.settings.docker_pool_size} ready):"
                    f" {self.last_error}"
                )
            if self.last_error and not self._live and self.created == 0 and self.failures >= 2:
                raise SandboxUnavailable(f"cannot start sandbox containers: {self.last_error}")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        """Remove every container this pool made, its socket dirs and its lock."""
        self._closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(SandboxUnavailable("the docker pool is closing"))
        # Let containers being created finish (each removes itself once it sees `_closed`):
        # cancelling would leave a create running in its worker thread, beyond our reach.
        pending = set(self._tasks)
        if pending:
            _, late = await asyncio.wait(pending, timeout=self.settings.docker_start_timeout_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        live = list(self._live.values())
        self._live.clear()
        for c in live:
            c.conn.close()
        await asyncio.gather(
            *(remove_container(self.client, c.id, c.socket_dir) for c in live),
            return_exceptions=True,
        )
        # anything labelled with our pool id that slipped through (e.g. a create cut short)
        try:
            leftovers = await asyncio.to_thread(
                self.client.containers.list,
                all=True,
                filters={"label": f"{POOL_LABEL}={self.pool_id}"},
            )
            for c in leftovers:
                await asyncio.to_thread(remove_container_sync, self.client, c.id)
        except (docker.errors.DockerException, OSError) as exc:  # requests' errors too
            # The engine cannot be reached: the next instance's start reaps what is left (our
            # lock is gone then). This raised, failing the shutdown and keeping dir and lock.
            log.warning("containers of pool %s left to the next start: %s", self.pool_id, exc)
        shutil.rmtree(self.dir, ignore_errors=True)
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.lock_path)
            os.close(self._lock_fd)
            self._lock_fd = None

    # ------------------------------------------------------------ runs

    async def acquire(self, deadline: Deadline) -> SandboxContainer:
        """A clean idle container; waits (bounded by the deadline) while all are busy or starting."""
        if self._closed:
            raise SandboxUnavailable("the docker pool is closed")
        if not self._waiters:
            while self._idle:
                container = self._idle.popleft()
                if container.id not in self._live:
                    continue
                if container.conn.closed:
                    # Died while idle (an engine restart kills them all): each run retried
                    # once, so a pool of N dead ones failed N/2 runs before one got a live one.
                    self.discard(container, "its agent hung up while it was idle")
                    continue
                return container
        # First come, first served: a freed container is handed to the oldest waiter, so a
        # newcomer can never overtake a run that has been waiting (no starvation at high load).
        waiter: asyncio.Future[SandboxContainer] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(deadline.remaining()):
                return await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._offer(waiter.result())  # handed over just as we gave up: pass it on
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):  # the deadline's: a TimeLimitExceeded answer
                raise ExpiredInQueue(
                    f"no sandbox container became free before the deadline ({len(self._live)} "
                    f"live, {self._starting} starting; last error: {self.last_error})"
                ) from None
            raise

    def _offer(self, container: SandboxContainer) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(container)
                return
        self._idle.append(container)

    def _fail_waiters(self, message: str) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(SandboxUnavailable(message))

    def release(self, container: SandboxContainer) -> None:
        """Back to the idle queue (the caller has seen the agent's clean reset)."""
        if self._closed or container.id not in self._live:
            return
        if container.runs >= self.settings.docker_max_runs_per_container:
            self.discard(container, "recycled after its run budget")
            return
        self._offer(container)

    def discard(self, container: SandboxContainer, reason: str) -> None:
        """Destroy a container in the background and start its replacement."""
        if self._live.pop(container.id, None) is None:
            return
        log.info("destroying %s: %s", container.name, reason)
        self.recycled += 1
        container.conn.close()
        self._spawn(self._remove(container))
        self._refill()

    async def _remove(self, container: SandboxContainer) -> None:
        """Remove a container; while the engine cannot be reached (it restarts), retry each
        `RETRY_PAUSE_S` until it can or the pool closes (whose sweep, or the next instance's
        start, removes it then). A failed removal was never tried again: the container stayed
        for the service's lifetime, with a traceback in the log."""
        warned = False
        while True:
            try:
                await remove_container(self.client, container.id, container.socket_dir)
                return
            except (docker.errors.DockerException, OSError) as exc:  # requests' errors too
                if not warned:
                    log.warning("cannot remove %s yet (retrying): %s", container.name, exc)
                    warned = True
            if self._closed:
                return
            await asyncio.sleep(RETRY_PAUSE_S)
            if self._closed:
                return

    def background(self, coro: Any) -> None:
        self._spawn(coro)

    # ------------------------------------------------------------ refill

    def _refill(self) -> None:
        if self._closed:
            return
        missing = self.settings.docker_pool_size - len(self._live) - self._starting
        room = self.settings.docker_refill_concurrency - self._starting
        for _ in range(max(0, min(missing, room))):
            self._starting += 1
            self._spawn(self._start_one())

    async def _start_one(self) -> None:
        try:
            pause = self._retry_at - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)
            self._serial += 1
            name = f"toolenv-sbx-{self.pool_id}-{self._serial}"
            labels = {LABEL: "1", POOL_LABEL: self.pool_id, LOCK_LABEL: str(self.lock_path)}
            container = await create_container(
                self.client,
                self.settings,
                name,
                self.dir / str(self._serial),
                labels,
                self.settings.docker_start_timeout_s,
            )
        except asyncio.CancelledError:
            self._starting -= 1
            raise
        except Exception as exc:  # noqa: BLE001 - keep the pool alive; report in status()
            self._starting -= 1
            self.failures += 1
            self.last_error = str(exc)
            self._retry_at = time.monotonic() + RETRY_PAUSE_S
            log.warning("sandbox container failed to start: %s", exc)
            if not self._live:  # nothing to wait for: a run without a deadline waited forever
                self._fail_waiters(f"no sandbox container is running and none could start: {exc}")
            self._refill()
            return
        self._starting -= 1
        self.created += 1
        if self._closed:
            container.conn.close()
            await remove_container(self.client, container.id, container.socket_dir)
            return
        self._live[container.id] = container
        self._offer(container)
        self._refill()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        idle = len(self._idle)
        return {
            "pool_id": self.pool_id,
            "pool_size": self.settings.docker_pool_size,
            "live": len(self._live),
            "idle": idle,
            "busy": len(self._live) - idle,
            "refilling": self._starting,
            "waiting": len(self._waiters),
            "created": self.created,
            "recycled": self.recycled,
            "reaped_at_start": len(self.reaped),
            "last_error": self.last_error,
        }
