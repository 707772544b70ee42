"""Front-door guards: bearer keys, the non-loopback bind rule, body limit, rate limits."""

from __future__ import annotations

import logging

import httpx
import pytest
from gw_support import proxy_tool
from pydantic import ValidationError
from typer.testing import CliRunner

from gateway.control import EMULATED_KINDS
from gateway.control import router as control_router
from gateway.guard import UNMETERED_PATHS
from gateway.routes import router
from gateway.settings import GatewaySettings
from toolenv.cli import build_app
from toolenv_core.config import config_error

toolenv_app = build_app()

KEY = "s3cret-key-0123456789"


def test_api_keys_guard_every_route_but_probes_and_never_leak(upstream, gateway, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="toolenv.gateway")
    up = upstream("a")
    gw = gateway(
        [proxy_tool("echo", up.url), proxy_tool("down", "http://127.0.0.1:9")], api_keys=[KEY]
    )
    assert httpx.get(gw.url + "/healthz", timeout=5).status_code == 200
    for probe in ("/healthz", "/readyz"):  # load balancers probe with HEAD (it was a 405)
        head = httpx.head(gw.url + probe, timeout=5)
        assert head.status_code == httpx.get(gw.url + probe, timeout=5).status_code
        assert head.status_code != 405 and head.content == b""
    for path in ("/v1/tools", "/metrics", "/openapi.json"):
        r = httpx.get(gw.url + path, timeout=5)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    wrong = httpx.post(gw.url + "/v1/tools/echo/call", json={"arguments": {}}, timeout=5,
                       headers={"Authorization": "Bearer " + KEY[:-1]})  # fmt: skip
    assert wrong.status_code == 401 and KEY[:-1] not in wrong.text
    good = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(gw.url + "/v1/tools/echo/call", json={"arguments": {}}, timeout=5, headers=good)
    assert r.status_code == 200
    assert r.json()["result"]["authorization"] is None  # our key is not forwarded upstream
    r = httpx.post(gw.url + "/v1/tools/down/call", json={"arguments": {}}, timeout=10, headers=good)
    assert r.status_code == 503 and KEY not in r.text
    assert caplog.records, "the failed call was logged"
    assert all(KEY not in rec.getMessage() and KEY not in str(vars(rec)) for rec in caplog.records)
    assert any(str(vars(rec).get("caller", "")).startswith("key-") for rec in caplog.records)
    assert KEY not in httpx.get(gw.url + "/metrics", timeout=5, headers=good).text
    assert KEY not in repr(GatewaySettings(api_keys=[KEY]))


def test_non_loopback_bind_without_keys_is_refused() -> None:
    with pytest.raises(ValueError, match="--allow-unauthenticated"):
        GatewaySettings(host="0.0.0.0").check_bind()
    GatewaySettings(host="0.0.0.0", api_keys=[KEY]).check_bind()
    GatewaySettings(host="0.0.0.0", allow_unauthenticated=True).check_bind()
    GatewaySettings(host="::1").check_bind()
    result = CliRunner().invoke(toolenv_app, ["serve", "--host", "0.0.0.0", "--port", "1"])
    assert result.exit_code == 2
    assert (
        "refusing to bind 0.0.0.0" in result.output and "--allow-unauthenticated" in result.output
    )


def test_keys_come_from_the_environment_comma_separated(monkeypatch) -> None:
    monkeypatch.setenv("TOOLENV_GATEWAY_API_KEYS", "k1, k2")
    assert [k.get_secret_value() for k in GatewaySettings().api_keys] == ["k1", "k2"]
    monkeypatch.setenv("TOOLENV_GATEWAY_API_KEYS", '["k3"]')
    assert [k.get_secret_value() for k in GatewaySettings().api_keys] == ["k3"]


@pytest.mark.parametrize(
    ("keys", "said"),
    [('[""]', "key 0 is empty, which would let in any `Authorization: Bearer `"),
     ('["  "]', "key 0 is empty"), ('[k1, " k2"]', "key 1 starts or ends with whitespace")],
)  # fmt: skip
def test_an_empty_or_unsendable_key_is_refused(tmp_path, keys: str, said: str) -> None:
    """Before: `api_keys: [""]` (say `["${KEY}"]` with KEY unset) let the gateway bind 0.0.0.0,
    a key being set, and `Authorization: Bearer ` with nothing after it passed as that key."""
    config = tmp_path / "toolenv.yaml"
    config.write_text(f"gateway:\n  api_keys: {keys}\n")
    with pytest.raises(ValidationError) as caught:
        GatewaySettings.load(config, host="0.0.0.0")
    message = config_error(caught.value)
    assert message.startswith(f"invalid gateway settings: api_keys: {said}"), message
    assert "k2" not in message  # a key is never echoed


def test_request_body_limit_is_413_with_or_without_content_length(upstream, gateway) -> None:
    up = upstream("a")
    gw = gateway([proxy_tool("echo", up.url, kind="search")], max_body_bytes=2048)
    big = {"arguments": {"blob": "x" * 4096}}
    r = httpx.post(gw.url + "/v1/tools/echo/call", json=big, timeout=5)
    assert r.status_code == 413 and "2048" in r.json()["detail"]

    def chunks():
        for _ in range(8):
            yield b"x" * 1024

    r = httpx.post(gw.url + "/retrieve", content=chunks(), timeout=5)
    assert r.status_code == 413
    assert up.stats()["started"] == 0  # nothing oversized reached the upstream
    ok = httpx.post(
        gw.url + "/v1/tools/echo/call", json={"arguments": {"blob": "x" * 100}}, timeout=5
    )
    assert ok.status_code == 200


def test_per_key_rate_limit_is_429_with_retry_after(upstream, gateway) -> None:
    up = upstream("a")
    gw = gateway([proxy_tool("echo", up.url)], api_keys=["k1", "k2"], rate_limit_per_s=0.5,
                 rate_limit_burst=3)  # fmt: skip
    k1, k2 = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}
    codes = [
        httpx.post(
            gw.url + "/v1/tools/echo/call", json={"arguments": {}}, headers=k1, timeout=5
        ).status_code
        for _ in range(5)
    ]
    assert codes == [200, 200, 200, 429, 429]
    r = httpx.post(gw.url + "/v1/tools/echo/call", json={"arguments": {}}, headers=k1, timeout=5)
    assert (
        r.status_code == 429
        and int(r.headers["retry-after"]) >= 1
        and "rate limit" in r.json()["detail"]
    )
    # the other key has its own bucket
    r = httpx.post(gw.url + "/v1/tools/echo/call", json={"arguments": {}}, headers=k2, timeout=5)
    assert r.status_code == 200


def test_rate_limit_spares_probes_the_scraper_and_the_control_routes(upstream, gateway) -> None:
    """Before: once a caller's bucket was empty, its /metrics scrape, its health probes and an
    operator's profile change from the same key were 429s too."""
    up = upstream("a")
    tools = [
        proxy_tool("echo", up.url),
        proxy_tool("sandbox", up.url, kind="sandbox"),
        proxy_tool("search", up.url, kind="search"),
    ]
    gw = gateway(tools, api_keys=[KEY], rate_limit_per_s=0.001, rate_limit_burst=1)
    good = {"Authorization": f"Bearer {KEY}"}
    call = {"json": {"arguments": {}}, "headers": good, "timeout": 5}
    assert httpx.post(gw.url + "/v1/tools/echo/call", **call).status_code == 200
    assert httpx.post(gw.url + "/v1/tools/echo/call", **call).status_code == 429  # bucket empty
    for method, path in [
        ("GET", "/metrics"), ("GET", "/healthz"), ("HEAD", "/readyz"), ("GET", "/v1/tools"),
        ("GET", "/v1/ping"), ("GET", "/v1/sandbox/status"), ("GET", "/v1/languages"),
        ("GET", "/v1/emulators/search/profile"), ("PUT", "/v1/emulators/search/profile"),
    ]:  # fmt: skip
        r = httpx.request(method, gw.url + path, headers=good, timeout=5, json={})
        assert r.status_code != 429, (path, r.text)
    assert httpx.get(gw.url + "/metrics", timeout=5).status_code == 401  # the key still applies
    assert httpx.post(gw.url + "/retrieve", **call).status_code == 429  # tool calls stay metered
    assert httpx.get(gw.url + "/openapi.json", headers=good, timeout=5).status_code == 429


def test_every_operational_and_control_route_is_unmetered() -> None:
    """A route added to the ops or control set must be added to the rate limit's exemptions."""
    ops = {r.path for r in router.routes if "ops" in getattr(r, "tags", [])}
    control = {r.path for r in control_router.routes}
    expanded = {p.replace("{name}", kind) for p in control for kind in EMULATED_KINDS}
    assert ops | expanded <= UNMETERED_PATHS
