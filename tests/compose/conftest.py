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
    delegated_cgroups,
    project_leftovers,
    remove_dangling_test_images,
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
        s.client.close()
        # Every profile: a service a test started under one (vllm-cpu) goes down too.
        down = s.compose("--profile", "*", "down", "-v", "--timeout", "10")
        for d in delegated_cgroups(project):
            if d.is_dir():
                d.rmdir()  # fails (and fails the run) if sandboxd left a cgroup in it
        remove_dangling_test_images()
    assert down.returncode == 0, down.stderr
    assert project_leftovers(project) == {"container": [], "network": [], "volume": []}
