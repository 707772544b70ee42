"""`toolenv sandboxd serve --backend docker`: the service picks the docker backend, runs code in
the warm pool, reports the pool in its status, and removes every container when stopped."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.docker
REPO = Path(__file__).resolve().parents[2]


def test_serve_with_docker_backend(toolenv_server, base_image: str) -> None:
    env = {
        "TOOLENV_BASE_IMAGE": base_image,
        "TOOLENV_SANDBOX_DOCKER_IMAGE": "toolenv/sandbox:0.1.0",
    }
    subprocess.run(
        [str(REPO / "scripts/build_sandbox_image.sh")], env={**os.environ, **env}, check=True
    )
    server = toolenv_server(
        "sandboxd", "serve", "--backend", "docker", env={"TOOLENV_SANDBOX_DOCKER_POOL_SIZE": "2"}
    )
    status = httpx.get(server.url + "/v1/sandbox/status", timeout=30).json()
    assert status["backend"] == "docker" and status["pool_size"] == 2 and status["live"] == 2
    body = {"language": "cpp", "code": '#include <cstdio>\nint main(){std::puts("hi from cpp");}'}
    r = httpx.post(server.url + "/run_code", json=body, timeout=60).json()
    assert r["status"] == "Success", r
    assert r["run_result"]["stdout"] == "hi from cpp\n"
    assert r["executor_pod_name"].startswith(f"toolenv-sbx-{status['pool_id']}-")
    assert server.stop() == 0  # a clean shutdown (SIGINT), which closes the pool
    left = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=toolenv.pool={status['pool_id']}"],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert left == [], "containers left after the service stopped"
