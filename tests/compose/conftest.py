"""One compose stack for every compose test (see compose_support.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from compose_support import (
    IMAGE,
    REPO,
    Stack,
)
from testkit import free_port


@pytest.fixture(scope="session")
def stack(compose_v2: str, base_image: str) -> Iterator[Stack]:
    project = f"toolenv-test-{os.getpid()}"
    port = free_port()
    env = {
        **os.environ,
        "COMPOSE_PROJECT_NAME": project,
        "TOOLENV_IMAGE": IMAGE,
        "TOOLENV_BASE_IMAGE": base_image,
        "TOOLENV_PORT": str(port),
        "PYTHON": sys.executable,
    }
    house = subprocess.run(
        ["bash", str(REPO / "scripts" / "build_wheelhouse.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert house.returncode == 0, house.stdout + house.stderr
    s = Stack(project, f"http://127.0.0.1:{port}", env)
    started = time.monotonic()
    try:
        # `docker compose up` from the repository root; --build so the image has this tree's code.
        up = s.compose("up", "-d", "--build", "--wait", "--wait-timeout", "240")
        assert up.returncode == 0, up.stderr[-4000:] + s.logs()
        s.started_s = time.monotonic() - started
        yield s
    finally:
        s.down()  # a no-op when the last test that used it took it down


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """The stack goes down after the last test that uses it, not at the end of the session: its
    healthchecks (a python process every 2 s in each container) took CPU from every later test,
    the timed ones among them."""
    stack = item.funcargs.get("stack")  # type: ignore[attr-defined]
    if not isinstance(stack, Stack) or stack.is_down:
        return
    later = item.session.items[item.session.items.index(item) + 1 :]
    if not any("stack" in getattr(other, "fixturenames", ()) for other in later):
        stack.down()
