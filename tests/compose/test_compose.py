"""`docker compose up` brings the whole environment up: gateway (proxy) -> sandboxd, emulators."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "compose" / "docker-compose.yml"


def _compose(
    project: str, *args: str, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", "compose", "-p", project, "-f", str(COMPOSE_FILE), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def toolenv_image(compose_v2: str, base_image: str) -> str:
    image = "toolenv/toolenv:test"
    env = {
        **os.environ,
        "TOOLENV_IMAGE": image,
        "TOOLENV_BASE_IMAGE": base_image,
        "PYTHON": sys.executable,
    }
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "build_toolenv_image.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return image


def _containers(project: str) -> list[str]:
    out = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"],
        capture_output=True,
        text=True,
    )
    return out.stdout.split()


def test_compose_up_serves_every_tool_through_the_gateway(toolenv_image: str, port: int) -> None:
    project = f"toolenv-test-{os.getpid()}"
    env = {**os.environ, "TOOLENV_IMAGE": toolenv_image, "TOOLENV_PORT": str(port)}
    url = f"http://127.0.0.1:{port}"
    try:
        up = _compose(project, "up", "-d", "--wait", "--wait-timeout", "180", env=env)
        logs = _compose(project, "logs", "--no-color", env=env).stdout if up.returncode else ""
        assert up.returncode == 0, up.stderr + logs

        ready = httpx.get(url + "/readyz", timeout=10)
        assert ready.status_code == 200, ready.text

        run = httpx.post(
            url + "/run_code", json={"code": "print(6*7)", "language": "python"}, timeout=60
        )
        assert run.status_code == 200, run.text
        body = run.json()
        assert body["status"] == "Success", body
        assert body["run_result"]["stdout"].strip() == "42"

        found = httpx.post(
            url + "/retrieve", json={"queries": ["who wrote hamlet"], "topk": 3}, timeout=60
        )
        assert found.status_code == 200, found.text
        assert len(found.json()["result"][0]) == 3

        call = httpx.post(
            url + "/v1/tools/search/call", json={"arguments": {"query": "rl"}}, timeout=60
        )
        assert call.status_code == 200 and call.json()["status"] == "ok", call.text

        tools = {
            t["function"]["name"] for t in httpx.get(url + "/v1/tools", timeout=10).json()["tools"]
        }
        assert {"sandbox", "search", "reward"} <= tools
    finally:
        down = _compose(project, "down", "-v", "--timeout", "5", env=env)
        assert down.returncode == 0, down.stderr
    assert _containers(project) == [], "compose down left containers behind"
