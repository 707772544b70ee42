"""sandboxd serve stopping with a run in flight past its `shutdown_grace_s`.

Before, uvicorn cancelled the handler and answered its own `500 Internal Server Error` (text):
the run was cut, and the caller (and a gateway, which passed the 500 on) could not tell why.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from sbx_support import SandboxdServer

pytestmark = pytest.mark.bwrap


def _run_under_way(server: SandboxdServer, sleep_s: int) -> tuple[threading.Thread, list]:
    """A /run_code of a program that sleeps `sleep_s`, called on a thread; back once it runs."""
    answers: list[httpx.Response] = []
    code = f"import time\nprint('start', flush=True)\ntime.sleep({sleep_s})\nprint('done')"

    def call() -> None:
        body = {"code": code, "language": "python", "run_timeout": 2 * sleep_s}
        answers.append(httpx.post(server.url + "/run_code", json=body, timeout=30))

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(1.0)  # the run is under way
    return caller, answers


def test_a_run_cut_by_the_shutdown_grace_is_a_503_that_says_so(
    sandboxd_factory: Callable[..., SandboxdServer],
) -> None:
    server = sandboxd_factory(
        "--backend", "process", env={"TOOLENV_SANDBOX_SHUTDOWN_GRACE_S": "0.3"}
    )
    caller, answers = _run_under_way(server, 5)
    server.proc.send_signal(signal.SIGTERM)
    caller.join(30)
    server.proc.wait(30)
    assert answers, "no answer"
    r = answers[0]
    assert r.status_code == 503, (r.status_code, r.text)
    assert "shutdown_grace_s" in r.json()["detail"], r.text
    # the cut is said in uvicorn's one line, not a traceback per call cut
    log = server.proc.stdout.read().decode(errors="replace") if server.proc.stdout else ""
    assert "Cancel 1 running task(s)" in log and "Traceback" not in log, log


def test_a_second_ctrl_c_cuts_the_run_with_a_503_then_closes_the_backend(
    sandboxd_factory: Callable[..., SandboxdServer],
) -> None:
    """A second Ctrl-C (uvicorn's force exit) left the runs going and skipped the app's shutdown:
    asyncio cancelled both at once as the process ended, the backend closing under the run. Its
    caller got a 200 `sandbox backend error: OSError: [Errno 19] No such device`, and stderr two
    tracebacks (the run's, the lifespan's)."""
    server = sandboxd_factory("--backend", "process")
    root = server.client.get("/v1/sandbox/status").json()["workdir_root"]
    caller, answers = _run_under_way(server, 10)
    server.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)  # the graceful stop waits for the run
    server.proc.send_signal(signal.SIGINT)
    caller.join(30)
    assert server.proc.wait(30) == 0
    assert answers, "no answer"
    r = answers[0]
    assert r.status_code == 503, (r.status_code, r.text)
    assert "a second Ctrl-C" in r.json()["detail"], r.text
    log = server.proc.stdout.read().decode(errors="replace") if server.proc.stdout else ""
    assert "Traceback" not in log, log
    assert not os.path.exists(root), f"{root} left behind"  # the backend was closed
