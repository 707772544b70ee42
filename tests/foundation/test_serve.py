"""`toolenv serve` as a real subprocess on loopback."""

from __future__ import annotations

import signal

import httpx


def test_serve_answers_readyz_and_openapi_and_stops_on_sigint(toolenv_server) -> None:
    server = toolenv_server("serve")
    ready = httpx.get(server.url + "/readyz", timeout=5)
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready"
    assert httpx.get(server.url + "/healthz", timeout=5).json() == {"status": "ok"}
    spec = httpx.get(server.url + "/openapi.json", timeout=5).json()
    assert spec["info"]["title"] == "toolenv gateway"
    assert "/readyz" in spec["paths"]
    assert server.stop(signal.SIGINT) == 0
    try:
        httpx.get(server.url + "/healthz", timeout=1)
        raise AssertionError("the server still answers after SIGINT")
    except httpx.ConnectError:
        pass
