"""sandboxd marks an answer its call's deadline ended (`X-Toolenv-Deadline-Expired: 1`), on
`/run_code` and `/v1/run_tests`, and never one a program's own run_timeout ended: the body is
SandboxFusion's TimeLimitExceeded either way, and the header is what lets a gateway count the
first as its `timeout` (before, both were plain 200s). Real server, real bwrap, loopback."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from sbx_support import SandboxdServer

from toolenv_core import headers as h

pytestmark = pytest.mark.bwrap

REPO = Path(__file__).resolve().parents[2]
SANDBOX_IMAGE = "toolenv/sandbox:0.1.0"
STARTED_THEN_SLEEP = "import time\nprint('started', flush=True)\ntime.sleep(30)\n"


@pytest.fixture(scope="module")
def server(sandboxd_factory: Callable[..., SandboxdServer]) -> SandboxdServer:
    return sandboxd_factory("--max-concurrency", "4")


def _post(server: SandboxdServer, path: str, body: dict, deadline_ms: str | None) -> httpx.Response:
    headers = {h.DEADLINE: deadline_ms} if deadline_ms is not None else {}
    r = server.client.post(path, json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r


def test_run_code_marks_the_deadlines_time_limit_not_the_programs_own(
    server: SandboxdServer,
) -> None:
    body = {"code": STARTED_THEN_SLEEP, "language": "python", "run_timeout": 30}
    started = time.monotonic()
    r = _post(server, "/run_code", body, "800")
    assert time.monotonic() - started < 3.0
    assert r.headers.get(h.DEADLINE_EXPIRED) == "1", r.headers
    # the body is SandboxFusion's, with the output so far
    assert r.json()["status"] == "Failed"
    assert r.json()["run_result"]["status"] == "TimeLimitExceeded"
    assert r.json()["run_result"]["stdout"] == "started\n"
    # the program's own run_timeout, under a long deadline or none: the same body, no header
    own = {**body, "run_timeout": 0.5}
    for deadline in ("20000", None):
        r = _post(server, "/run_code", own, deadline)
        assert r.json()["run_result"]["status"] == "TimeLimitExceeded", r.text
        assert h.DEADLINE_EXPIRED not in r.headers, (deadline, r.headers)
    ok = _post(server, "/run_code", {"code": "print(1)", "language": "python"}, "20000")
    assert ok.json()["status"] == "Success" and h.DEADLINE_EXPIRED not in ok.headers


def test_run_tests_marks_the_deadlines_time_limit_not_the_cases_own(server: SandboxdServer) -> None:
    cut = {"code": STARTED_THEN_SLEEP, "language": "python", "cases": [{}, {}], "timeout": 30}
    r = _post(server, "/v1/run_tests", cut, "800")
    assert r.json()["verdict"] == "time_limit", r.text
    assert r.headers.get(h.DEADLINE_EXPIRED) == "1", r.headers
    own = {**cut, "timeout": 0.5}
    r = _post(server, "/v1/run_tests", own, "20000")
    assert r.json()["verdict"] == "time_limit", r.text
    assert h.DEADLINE_EXPIRED not in r.headers, r.headers


def test_a_compile_cut_by_the_deadline_carries_the_header(server: SandboxdServer) -> None:
    # g++ on <iostream> and <regex> takes far longer than 150 ms
    code = '#include <iostream>\n#include <regex>\nint main(){std::regex r("a+");}'
    body = {"code": code, "language": "cpp", "run_timeout": 5, "compile_timeout": 30}
    r = _post(server, "/run_code", body, "150")
    steps = [r.json()["compile_result"], r.json()["run_result"]]
    assert any(s and s["status"] == "TimeLimitExceeded" for s in steps), r.text
    assert r.headers.get(h.DEADLINE_EXPIRED) == "1", r.headers


@pytest.mark.docker
def test_the_docker_backend_marks_the_deadlines_time_limit_too(toolenv_server, base_image) -> None:
    """The agent answers a cut run 150 ms before the deadline (its answer margin): still marked."""
    env = {"TOOLENV_BASE_IMAGE": base_image, "TOOLENV_SANDBOX_DOCKER_IMAGE": SANDBOX_IMAGE}
    subprocess.run(
        [str(REPO / "scripts/build_sandbox_image.sh")], env={**os.environ, **env}, check=True
    )
    docker = toolenv_server(
        "sandboxd", "serve", "--backend", "docker", "--max-concurrency", "4",
        env={"TOOLENV_SANDBOX_DOCKER_POOL_SIZE": "1"},
    )  # fmt: skip
    client = httpx.Client(base_url=docker.url, timeout=60)
    body = {"code": STARTED_THEN_SLEEP, "language": "python", "run_timeout": 30}
    r = client.post("/run_code", json=body, headers={h.DEADLINE: "1500"})
    assert r.json()["run_result"]["status"] == "TimeLimitExceeded", r.text
    assert r.json()["run_result"]["stdout"] == "started\n", r.text
    assert r.headers.get(h.DEADLINE_EXPIRED) == "1", r.headers
    r = client.post("/run_code", json={**body, "run_timeout": 0.5}, headers={h.DEADLINE: "20000"})
    assert r.json()["run_result"]["status"] == "TimeLimitExceeded", r.text
    assert h.DEADLINE_EXPIRED not in r.headers, r.headers
    # A deadline that runs out while the call waits for the pool's one container (busy with a
    # run of its own) ends it as a TimeLimitExceeded too, marked: not a "sandbox unavailable"
    # SandboxError counted as the tool's failure. Admission is capped at the pool's size, so the
    # call waits in admission (the pool's own wait: test_docker_pool.py).
    held = {**body, "run_timeout": 4}
    busy = threading.Thread(target=httpx.post, args=(f"{docker.url}/run_code",),
                            kwargs={"json": held, "timeout": 60})  # fmt: skip
    busy.start()
    time.sleep(1.0)  # the container is taken for the next 3 s
    r = client.post("/run_code", json=body, headers={h.DEADLINE: "700"})
    assert r.json()["run_result"]["status"] == "TimeLimitExceeded", r.text
    message = r.json()["message"]  # the wait as measured: "after 0.7 s", "after 0.699 s"
    assert "deadline ran out after 0." in message and "s waiting for a slot" in message, r.text
    assert r.headers.get(h.DEADLINE_EXPIRED) == "1", r.headers
    busy.join(timeout=60)
    client.close()
