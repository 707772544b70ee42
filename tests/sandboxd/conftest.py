"""sandboxd fixtures: real `toolenv sandboxd serve` processes on loopback (process backend), and
the Docker backend's image, portal and pool."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal
from docker_support import build_sandbox_image, labelled
from sbx_support import SandboxdServer, start_sandboxd

from sandboxd.docker_backend import DockerBackend
from sandboxd.settings import SandboxSettings


@pytest.fixture(scope="module")
def sandboxd_factory(bwrap_path: str) -> Iterator[Callable[..., SandboxdServer]]:
    """Start real `toolenv sandboxd serve` processes; all are stopped at module end."""
    servers: list[SandboxdServer] = []

    def start(*args: str, env: dict[str, str] | None = None, **kw: Any) -> SandboxdServer:
        server = start_sandboxd(*args, env=env, **kw)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def sandboxd(sandboxd_factory: Callable[..., SandboxdServer]) -> SandboxdServer:
    """One process-backend server per module (4 programs at once)."""
    server = sandboxd_factory("--backend", "process", "--max-concurrency", "4")
    server.run_code(code="print(1)")  # warm the first-run paths before the baseline
    server.probe.baseline()
    return server


@pytest.fixture(scope="module")
def api(sandboxd_factory: Callable[..., SandboxdServer]) -> SandboxdServer:
    """One process-backend server per module for the API tests (4 programs at once, bodies up
    to 64 KiB: a bigger one is a 413)."""
    return sandboxd_factory(
        "--max-concurrency", "4", env={"TOOLENV_SANDBOX_MAX_BODY_BYTES": "65536"}
    )


@pytest.fixture(scope="module")
def image(base_image: str) -> str:
    """The sandbox image of the Docker backend."""
    return build_sandbox_image(base_image)


@pytest.fixture(scope="module")
def portal() -> Iterator[BlockingPortal]:
    """An event loop in a thread, for the Docker backend's coroutines."""
    with start_blocking_portal(backend="asyncio") as p:
        yield p


@pytest.fixture(scope="module")
def backend(portal: BlockingPortal, image: str) -> Iterator[DockerBackend]:
    """A Docker backend with a pool of 2 containers per module; it leaves none behind."""
    b = DockerBackend(SandboxSettings(docker_image=image, docker_pool_size=2, run_cpu_shares=512))
    portal.call(b.start)
    yield b
    pool_id = b.pool.pool_id
    portal.call(b.close)
    assert labelled(f"toolenv.pool={pool_id}") == []
