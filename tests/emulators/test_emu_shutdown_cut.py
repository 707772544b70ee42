"""`toolenv emulators serve` stopping with a call in flight past its shutdown grace (5 s).

Before, uvicorn cancelled the handler and answered its own `500 Internal Server Error` (text):
under compose, `docker compose restart search` during a slow search gave the caller, through the
gateway, a 500 it could not tell from a failing service.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
from emu_support import start_server

from emulators.cli import SHUTDOWN_GRACE_S


def test_a_call_cut_by_the_shutdown_grace_is_a_503_that_says_so() -> None:
    server = start_server()
    answers: list[httpx.Response] = []

    def call() -> None:
        body = {"query": "q", "delay_s": SHUTDOWN_GRACE_S + 10}
        answers.append(httpx.post(server.url + "/v1/emulators/search/call", json=body, timeout=60))

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.5)  # the call is sleeping its delay
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    caller.join(60)
    server.stop()
    assert answers, "no answer"
    r = answers[0]
    assert r.status_code == 503, (r.status_code, r.text)
    detail = r.json()["detail"]
    assert "emulators stopped before this call finished" in detail, detail
    assert f"{SHUTDOWN_GRACE_S} s after SIGTERM" in detail, detail
    # the cut is said in uvicorn's one line, not a traceback per call cut
    log = server.output()
    assert "Cancel 1 running task(s)" in log and "Traceback" not in log, log
