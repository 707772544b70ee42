"""Proxy mode's upstreams on loopback: down, killed, balanced, health-checked, retried, hedged."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from gw_support import call, metric_value, proxy_tool
from pydantic import ValidationError


def test_upstream_down_is_503_naming_the_tool_and_readyz_says_so(upstream, gateway) -> None:
    up = upstream("gone")
    gw = gateway([proxy_tool("search", up.url, kind="search")])
    assert httpx.get(gw.url + "/readyz", timeout=5).status_code == 200
    up.kill()
    r = httpx.post(gw.url + "/retrieve", json={"queries": ["x"]}, timeout=10)
    assert r.status_code == 503
    assert r.json()["status"] == "unavailable" and "'search'" in r.json()["error"]
    r = call(gw, "search", {"query": "x"})
    assert r.status_code == 503 and "search" in r.json()["error"]
    ready = httpx.get(gw.url + "/readyz", timeout=5)
    assert ready.status_code == 503 and "'search'" in ready.json()["detail"]


async def test_upstream_killed_mid_request_is_502_and_other_calls_are_unaffected(
    upstream, gateway
) -> None:
    doomed, healthy = upstream("doomed"), upstream("healthy")
    gw = gateway([proxy_tool("fragile", doomed.url), proxy_tool("steady", healthy.url)])
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        others = [
            client.post("/v1/tools/steady/call", json={"arguments": {"sleep_s": 0.2, "i": i}})
            for i in range(20)
        ]
        dying = client.post("/v1/tools/fragile/call", json={"arguments": {"die": True}})
        results = await asyncio.gather(dying, *others)
    assert results[0].status_code == 502, results[0].text
    assert (
        results[0].json()["status"] == "upstream_failed" and "fragile" in results[0].json()["error"]
    )
    assert [r.status_code for r in results[1:]] == [200] * 20
    assert sorted(r.json()["result"]["body"]["i"] for r in results[1:]) == list(range(20))
    assert doomed.proc.wait(timeout=5) == 17


def test_least_outstanding_balancing_and_health_checks(upstream, gateway) -> None:
    a, b = upstream("a"), upstream("b")
    sick = upstream("sick", unhealthy=True)
    gw = gateway([proxy_tool("pool", a.url, b.url, sick.url, concurrency=8)])
    # the unhealthy upstream is never chosen while healthy ones exist
    seen = [call(gw, "pool", {"i": i}).json()["result"]["upstream"] for i in range(12)]
    assert "sick" not in seen and set(seen) == {"a", "b"}
    # with one upstream busy, calls go to the other (least outstanding)

    async def burst() -> list[str]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
            slow = asyncio.create_task(
                client.post("/v1/tools/pool/call", json={"arguments": {"sleep_s": 1.5}})
            )
            endpoints = gw.toolset.tools["pool"].backend.endpoints
            for _ in range(400):  # until the slow call is out at one upstream
                if sum(e.outstanding for e in endpoints) == 1:
                    break
                await asyncio.sleep(0.01)
            fast = [
                await client.post("/v1/tools/pool/call", json={"arguments": {}}) for _ in range(5)
            ]
            busy = (await slow).json()["result"]["upstream"]
            return [busy] + [r.json()["result"]["upstream"] for r in fast]

    busy, *rest = asyncio.run(burst())
    assert busy not in rest and len(set(rest)) == 1
    details = httpx.get(gw.url + "/v1/tools", timeout=5).json()["details"][0]
    health = {e["endpoint"]: e["healthy"] for e in details["endpoints"]}
    assert health == {a.url: True, b.url: True, sick.url: False}


def test_retries_only_connection_errors_and_count_them(upstream, gateway) -> None:
    live, dead = upstream("live"), upstream("dead")
    dead.kill()
    gw = gateway(
        [
            proxy_tool(
                "retry",
                live.url,
                dead.url,
                retry={"enabled": True, "max_attempts": 2},
                health_interval_s=60,
            ),  # fmt: skip
            proxy_tool("noretry", live.url, dead.url, health_interval_s=60),
        ]
    )
    for name in ("retry", "noretry"):  # make both believe the dead one is healthy again
        for endpoint in gw.toolset.tools[name].backend.endpoints:
            endpoint.healthy = True
    # a tool's first call starts its round-robin at the second upstream, the dead one:
    # the retry moves to the live one
    r = call(gw, "retry", {})
    assert r.status_code == 200 and r.json()["result"]["upstream"] == "live"
    r = call(gw, "noretry", {})
    assert r.status_code == 503  # retries are off by default
    # an upstream that answered (even with 500) is never retried
    before = live.stats()["started"]
    r = call(gw, "retry", {"status": 500})
    assert r.status_code == 200 and r.json()["status"] == "error"
    assert live.stats()["started"] == before + 1
    text = gw.metrics_text()
    assert metric_value(text, "toolenv_gateway_retried_total", tool="retry") == 1
    assert metric_value(text, "toolenv_gateway_retried_total", tool="noretry") == 0


async def test_hedging_sends_a_second_attempt_and_cancels_the_loser(upstream, gateway) -> None:
    slow, fast = upstream("slow"), upstream("fast")
    hedge = {"enabled": True, "quantile": 0.5, "min_samples": 5, "min_delay_ms": 50}
    # a tool's first call starts its round-robin at the second upstream: the slow one
    gw = gateway([proxy_tool("h", fast.url, slow.url, hedge=hedge, idempotent=True)])
    runtime = gw.toolset.tools["h"]
    for _ in range(10):
        runtime.window.add(0.01)  # recent history: calls take 10 ms
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        started = time.monotonic()
        # "slow" is picked first and sleeps; the hedge (after ~50 ms) goes to "fast" and wins
        r = await client.post(
            "/v1/tools/h/call", json={"arguments": {"sleep_s": 3, "sleep_on": "slow"}}
        )
    assert time.monotonic() - started < 2.5
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.json()["result"]["upstream"] == "fast"
    text = gw.metrics_text()
    assert metric_value(text, "toolenv_gateway_hedged_total", tool="h") == 1
    # the losing attempt's connection was closed: the upstream noticed and stopped
    for _ in range(50):
        if slow.stats()["abandoned"] + fast.stats()["abandoned"] == 1:
            break
        await asyncio.sleep(0.05)
    assert slow.stats()["abandoned"] + fast.stats()["abandoned"] == 1


def test_an_upstream_url_with_a_path_serves_under_it(upstream, gateway) -> None:
    """`http://host/v1` as an upstream: its path was dropped, calls went to `/call` and health
    checks to `/ping` of the host (here, a 404 the check took for healthy)."""
    up = upstream("a", unhealthy=True)  # its /v1/ping answers 503
    gw = gateway([proxy_tool("t", up.url + "/v1/", health_path="/ping")])
    r = call(gw, "t", {"n": 1})  # with no healthy upstream the call still tries
    assert r.status_code == 200 and r.json()["result"]["path"] == "/v1/call", r.text
    ready = httpx.get(gw.url + "/readyz", timeout=10)
    assert ready.status_code == 503 and "health check answered 503" in ready.json()["detail"]


def test_hedging_a_tool_not_idempotent_is_a_settings_error_unless_it_says_it_is(
    upstream, gateway
) -> None:
    """A hedge on a sandbox (not idempotent by default) was switched off without a word."""
    a, b = upstream("a"), upstream("b")
    with pytest.raises(ValidationError, match=r"hedge.enabled needs `idempotent: true`"):
        proxy_tool("sandbox", a.url, b.url, kind="sandbox", hedge={"enabled": True})
    said = proxy_tool(
        "sandbox", a.url, b.url, kind="sandbox", idempotent=True, hedge={"enabled": True}
    )
    assert gateway([said]).toolset.tools["sandbox"].hedging is True


def test_keep_alive_connections_the_upstream_closed_are_not_reused(upstream, gateway) -> None:
    up = upstream("ka", keep_alive_s=0.3)  # the upstream drops idle connections sooner than we do
    gw = gateway([proxy_tool("ka", up.url, health_interval_s=60)], upstream_keepalive_s=60)
    for _ in range(3):
        assert call(gw, "ka", {}).status_code == 200
        time.sleep(0.6)  # the pooled connection is closed by the upstream meanwhile
    assert up.stats()["finished"] == 3
