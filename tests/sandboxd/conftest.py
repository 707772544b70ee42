"""sandboxd fixtures: real `toolenv sandboxd serve` processes on loopback (process backend)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sbx_support import SandboxdServer, start_sandboxd


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
