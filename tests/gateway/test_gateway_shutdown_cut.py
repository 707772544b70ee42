"""`toolenv gateway serve` stopping with calls in flight past its `shutdown_grace_s`.

Before, uvicorn cancelled them at the grace: a call on the lane (a hot route with a
Content-Length, what every client sends) got no answer at all, the connection just closed (under
compose, `docker compose restart gateway` during a long call), and one on the app's path (a
chunked body) uvicorn's plain-text 500.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import httpx
from test_process import write_config


def test_calls_cut_by_the_shutdown_grace_are_503s_that_say_so(
    upstream, toolenv_server, tmp_path
) -> None:
    up = upstream("slow")
    config = write_config(tmp_path / "gw.yaml", up.url, call_path="/native")
    server = toolenv_server(
        "gateway", "serve", "--mode", "proxy", "--config", str(config),
        env={"TOOLENV_GATEWAY_SHUTDOWN_GRACE_S": "0.5"},
    )  # fmt: skip
    body = b'{"arguments": {"sleep_s": 20}, "deadline_ms": 30000}'
    answers: dict[str, httpx.Response | httpx.HTTPError] = {}

    def chunked() -> Iterator[bytes]:
        yield body

    def call(name: str, content: bytes | Iterator[bytes]) -> None:
        try:
            answers[name] = httpx.post(
                server.url + "/v1/tools/search/call", content=content, timeout=30,
                headers={"content-type": "application/json"},
            )  # fmt: skip
        except httpx.HTTPError as exc:  # the connection closed with no answer
            answers[name] = exc

    callers = [
        threading.Thread(target=call, args=("lane", body)),
        threading.Thread(target=call, args=("app", chunked())),
    ]
    for t in callers:
        t.start()
    deadline = time.monotonic() + 10
    while up.stats()["started"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # both calls are at the upstream
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    for t in callers:
        t.join(30)
    server.stop()
    for name in ("lane", "app"):
        r = answers.get(name)
        assert isinstance(r, httpx.Response), (name, r)
        assert r.status_code == 503, (name, r.status_code, r.text)
        detail = r.json()["detail"]
        assert "the gateway stopped before this call finished" in detail, (name, detail)
        assert "shutdown_grace_s (0.5 s)" in detail, (name, detail)
    # the app's path answered its 503, then raised the cancellation on: uvicorn logged an
    # ERROR "Exception in ASGI application" with a 30-line traceback for each such call
    log = server.output()
    assert "Exception in ASGI application" not in log, log
    assert "cut_by_shutdown" in log, log
