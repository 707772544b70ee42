"""Proxy mode against real loopback upstreams: wire format, deadlines, metrics, backpressure."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest
from gw_support import call, metric_value, proxy_tool

from rollout_client.gateway_client import GatewayClient
from toolenv_core.deadline import Deadline


def test_a_reward_call_without_a_deadline_gets_time_for_a_batch(upstream, gateway) -> None:
    """A reward call sending no deadline had the tools' 30 s default: an emulated batch of 32
    (about 40 s) came back 504. A reward tool's default is 180 s (PolyTrace's batches of 64 take
    37-125 s), within its max_deadline_ms; other kinds keep 30 s, and a tool's own setting wins."""
    up = upstream("a")
    gw = gateway(
        [
            proxy_tool("reward", up.url, kind="reward", call_path="/native"),
            proxy_tool(
                "capped", up.url, kind="reward", call_path="/native", max_deadline_ms=60_000
            ),
            proxy_tool("set", up.url, kind="reward", call_path="/native", default_deadline_ms=5000),
            proxy_tool("echo", up.url, call_path="/native"),
        ]
    )
    for tool, expected in (
        ("reward", 180_000),
        ("capped", 60_000),
        ("set", 5000),
        ("echo", 30_000),
    ):
        r = call(gw, tool, {"batch_size": 32})
        assert r.status_code == 200, r.text
        forwarded = float(r.json()["result"]["deadline_ms"])
        assert expected - 1000 < forwarded <= expected, (tool, forwarded)


def test_generic_call_forwards_arguments_and_answers_the_documented_shape(
    upstream, gateway
) -> None:
    up = upstream("a")
    gw = gateway([proxy_tool("echo", up.url, call_path="/native", default_deadline_ms=5000)])
    r = call(gw, "echo", {"query": "hamlet"}, headers={"X-Request-Id": "rid-1"})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"tool", "status", "result", "error", "elapsed_s", "request_id"}
    assert body["tool"] == "echo" and body["status"] == "ok" and body["error"] is None
    assert body["request_id"] == "rid-1" and r.headers["x-request-id"] == "rid-1"
    result = body["result"]
    assert result["path"] == "/native" and result["body"] == {"query": "hamlet"}
    assert result["request_id"] == "rid-1"
    # the remaining budget travels downstream, below the default deadline
    assert 0 < float(result["deadline_ms"]) <= 5000
    # a chunked answer is reassembled
    chunked = call(gw, "echo", {"chunked": True, "pad": "x" * 100})
    assert chunked.status_code == 200 and chunked.json()["result"]["body"]["pad"] == "x" * 100
    # an upstream HTTP error is a tool result, not a gateway failure
    r = call(gw, "echo", {"status": 422})
    assert r.status_code == 200
    assert r.json()["status"] == "error" and "422" in r.json()["error"]
    assert r.json()["result"]["upstream"] == "a"
    # ...and so is its 504 long before the deadline it was told (5 s): a tool that stops at
    # that deadline is the call's timeout (tests/gateway/test_tool_504.py)
    r = call(gw, "echo", {"status": 504})
    assert r.status_code == 200
    assert r.json()["status"] == "error" and "504" in r.json()["error"]


def test_pass_through_routes_keep_the_upstream_wire_format(upstream, gateway) -> None:
    up = upstream("s")
    gw = gateway(
        [
            proxy_tool("sandbox", up.url, kind="sandbox"),
            proxy_tool("search", up.url, kind="search"),
        ]
    )
    for path, body in [
        ("/run_code", {"code": "print(1)", "language": "python"}),
        ("/v1/run_tests", {"code": "x", "tests": []}),
        ("/retrieve", {"queries": ["a"], "topk": 2}),
    ]:
        r = httpx.post(
            gw.url + path, json=body, timeout=10, headers={"X-Toolenv-Deadline-Ms": "2000"}
        )
        assert r.status_code == 200, r.text
        echoed = r.json()
        assert echoed["path"] == path and echoed["body"] == body
        assert float(echoed["deadline_ms"]) <= 2000
    r = httpx.post(gw.url + "/retrieve", json={"status": 418}, timeout=10)
    assert r.status_code == 418  # the upstream's status passes straight through
    r = httpx.post(
        gw.url + "/retrieve", json={}, timeout=10, headers={"X-Toolenv-Deadline-Ms": "soon"}
    )
    assert r.status_code == 400 and "X-Toolenv-Deadline-Ms" in r.json()["detail"]


def test_bad_requests_get_clear_client_errors(upstream, gateway) -> None:
    up = upstream("a")
    gw = gateway([proxy_tool("echo", up.url)])
    r = httpx.post(gw.url + "/v1/tools/echo/call", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "not valid JSON" in r.json()["detail"]
    r = httpx.post(gw.url + "/v1/tools/echo/call", json={"args": {}}, timeout=10)
    assert r.status_code == 422 and "arguments" in r.json()["detail"]
    r = httpx.post(
        gw.url + "/v1/tools/echo/call", json={"arguments": {}, "deadline_ms": -1}, timeout=10
    )
    assert r.status_code == 422
    r = call(gw, "nope", {})
    assert r.status_code == 404 and "nope" in r.json()["detail"] and "echo" in r.json()["detail"]
    r = httpx.post(gw.url + "/run_code", json={"code": "1"}, timeout=10)
    assert r.status_code == 404 and "sandbox" in r.json()["detail"]


def test_deadline_expiry_answers_at_once_and_closes_the_upstream_request(upstream, gateway) -> None:
    up = upstream("hung")
    gw = gateway([proxy_tool("slow", up.url, max_deadline_ms=60_000)])
    started = time.monotonic()
    r = httpx.post(f"{gw.url}/v1/tools/slow/call", timeout=30,
                   json={"arguments": {"sleep_s": 30}, "deadline_ms": 300})  # fmt: skip
    waited = time.monotonic() - started
    assert r.status_code == 504
    body = r.json()
    assert set(body) == {"tool", "status", "error", "elapsed_s", "deadline_ms", "request_id"}
    assert body["status"] == "timeout" and body["tool"] == "slow" and body["deadline_ms"] == 300
    assert 0.3 <= body["elapsed_s"] <= 0.35  # the gateway answered within 50 ms of the deadline
    assert waited < 2.0  # and the caller saw it promptly (loose: shared CI cores)
    # the upstream saw the connection close and stopped working on it
    for _ in range(50):
        if up.stats()["abandoned"] == 1:
            break
        time.sleep(0.05)
    assert up.stats() | {"deadline_ms": None} == {
        "started": 1,
        "finished": 0,
        "abandoned": 1,
        "deadline_ms": None,
    }
    # the header deadline works too, and is capped by the tool's maximum
    r = httpx.post(f"{gw.url}/v1/tools/slow/call", timeout=30, json={"arguments": {"sleep_s": 30}},
                   headers={"X-Toolenv-Deadline-Ms": "200"})  # fmt: skip
    assert r.status_code == 504 and r.json()["deadline_ms"] == 200
    assert (
        metric_value(
            gw.metrics_text(), "toolenv_gateway_calls_total", tool="slow", outcome="timeout"
        )
        == 2
    )


def test_deadline_is_capped_by_the_tools_maximum(upstream, gateway) -> None:
    up = upstream("hung")
    gw = gateway([proxy_tool("slow", up.url, default_deadline_ms=100, max_deadline_ms=250)])
    r = httpx.post(f"{gw.url}/v1/tools/slow/call", timeout=30,
                   json={"arguments": {"sleep_s": 30}, "deadline_ms": 100_000})  # fmt: skip
    assert r.status_code == 504 and r.json()["deadline_ms"] == 250
    r = call(gw, "slow", {"sleep_s": 30})
    assert r.status_code == 504 and r.json()["deadline_ms"] == 100


async def test_queue_wait_counts_against_the_deadline_and_overflow_gets_429(
    upstream, gateway, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="toolenv.gateway")
    up = upstream("q")
    gw = gateway([proxy_tool("one", up.url, concurrency=1, queue=1)])
    runtime = gw.toolset.tools["one"]

    async def until(condition) -> None:  # waits on the gateway's own state, not on timing
        for _ in range(400):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the gateway never reached the expected state")

    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        busy = asyncio.create_task(
            client.post(
                "/v1/tools/one/call", json={"arguments": {"sleep_s": 2.0}, "deadline_ms": 9000}
            )
        )
        await until(lambda: runtime.admission.in_flight == 1)
        queued = asyncio.create_task(
            client.post("/v1/tools/one/call", json={"arguments": {}, "deadline_ms": 500})
        )
        await until(lambda: runtime.admission.waiting == 1)
        overflow = await client.post("/v1/tools/one/call", json={"arguments": {}})
        assert overflow.status_code == 429
        assert int(overflow.headers["retry-after"]) >= 1
        assert overflow.json()["status"] == "rejected" and "saturated" in overflow.json()["error"]
        timed_out = await queued  # it never got the slot: the wait alone used up its deadline
        assert timed_out.status_code == 504 and "waiting for a slot" in timed_out.json()["error"]
        assert (await busy).status_code == 200
    assert up.stats()["started"] == 1  # the queued call never reached the upstream
    text = gw.metrics_text()
    assert metric_value(text, "toolenv_gateway_calls_total", tool="one", outcome="rejected") == 1
    # the call whose deadline ran out in the queue waited there too: before, it was left out of
    # the histogram and logged `queue_wait_ms: 0` ("waiting for a slot")
    assert metric_value(text, "toolenv_gateway_queue_wait_seconds_count", tool="one") == 2
    assert metric_value(text, "toolenv_gateway_queue_wait_seconds_sum", tool="one") >= 0.49
    [line] = [vars(r) for r in caplog.records if getattr(r, "outcome", None) == "timeout"]
    assert line["queue_wait_ms"] >= 490, line


def test_metrics_list_every_family_per_tool(upstream, gateway) -> None:
    up = upstream("m")
    gw = gateway([proxy_tool("m", up.url)])
    assert call(gw, "m", {"sleep_s": 0.05}).status_code == 200
    text = gw.metrics_text()
    for family in (
        "toolenv_gateway_queue_wait_seconds_bucket",
        "toolenv_gateway_upstream_seconds_bucket",
        "toolenv_gateway_injected_delay_seconds_bucket",
        "toolenv_gateway_call_seconds_bucket",
    ):
        assert f'{family}{{le="+Inf",tool="m"}} 1.0' in text, family
    assert metric_value(text, "toolenv_gateway_injected_delay_seconds_sum", tool="m") == 0.05
    assert metric_value(text, "toolenv_gateway_calls_total", tool="m", outcome="ok") == 1
    assert metric_value(text, "toolenv_gateway_in_flight", tool="m") == 0
    # the upstream sleeps on uvloop, whose timers count whole milliseconds: up to 1 ms early
    assert metric_value(text, "toolenv_gateway_upstream_seconds_sum", tool="m") >= 0.049


def test_every_counted_call_is_in_the_call_histogram(upstream, gateway) -> None:
    """Before: a call whose caller hung up counted in `calls_total{outcome="caller_gone"}` but not
    in `call_seconds`, so the histogram's count fell short of the calls (a dashboard's rate of
    calls from either disagreed)."""
    up = upstream("slow")
    gw = gateway([proxy_tool("m", up.url)])
    assert call(gw, "m", {}).status_code == 200
    try:
        httpx.post(gw.url + "/v1/tools/m/call", json={"arguments": {"sleep_s": 30}}, timeout=0.3)
    except httpx.ReadTimeout:
        pass  # hung up before the answer
    runtime = gw.toolset.tools["m"]
    for _ in range(100):  # until the gateway has seen the caller go
        if runtime.m.outcomes["caller_gone"].value == 1:
            break
        time.sleep(0.02)
    text = gw.metrics_text()
    calls = sum(
        metric_value(text, "toolenv_gateway_calls_total", tool="m", outcome=outcome)
        for outcome in ("ok", "caller_gone")
    )
    assert calls == 2
    assert metric_value(text, "toolenv_gateway_call_seconds_count", tool="m") == calls
    assert metric_value(text, "toolenv_gateway_call_seconds_sum", tool="m") >= 0.25


def test_tools_list_is_openai_function_format(upstream, gateway) -> None:
    up = upstream("t")
    gw = gateway(
        [proxy_tool("sandbox", up.url, kind="sandbox"), proxy_tool("search", up.url, kind="search")]
    )
    tools = httpx.get(gw.url + "/v1/tools", timeout=5).json()["tools"]
    assert [t["function"]["name"] for t in tools] == ["sandbox", "search"]
    for entry in tools:
        assert entry["type"] == "function"
        params = entry["function"]["parameters"]
        assert params["type"] == "object" and params["required"]
        assert set(params["required"]) <= set(params["properties"])
        assert entry["function"]["description"]


def test_pass_through_keeps_the_tools_retry_after(upstream, gateway) -> None:
    """A tool's own 429 (sandboxd at capacity, an emulator's throttle fault) reaches a
    SandboxFusion or Search-R1 client with its Retry-After: the backpressure signal, not a bare
    429."""
    up = upstream("busy")
    gw = gateway(
        [proxy_tool("sandbox", up.url, kind="sandbox"), proxy_tool("search", up.url, kind="search")]
    )
    for path in ("/run_code", "/v1/run_tests", "/retrieve"):
        r = httpx.post(gw.url + path, json={"status": 429, "retry_after": 7}, timeout=10)
        assert r.status_code == 429 and r.headers.get("retry-after") == "7", (path, r.headers)


def test_generic_call_keeps_the_tools_retry_after(upstream, gateway) -> None:
    """Before: the generic call answered a tool's own 429 as a tool error (200, `status: error`)
    without its Retry-After, so its caller could not tell when to try again."""
    up = upstream("busy")
    gw = gateway([proxy_tool("echo", up.url)])
    r = call(gw, "echo", {"status": 429, "retry_after": 7})
    assert r.status_code == 200 and r.json()["status"] == "error" and "429" in r.json()["error"]
    assert r.headers.get("retry-after") == "7", r.headers


async def test_the_rollout_client_waits_out_a_tools_own_backpressure(upstream, gateway) -> None:
    """Before: the rollout client retried the gateway's own 429 only; a tool's 429, answered by
    the generic call as a tool error with the tool's Retry-After, failed the tool call at once."""
    up = upstream("busy")
    gw = gateway([proxy_tool("echo", up.url)])
    client = GatewayClient(gw.url)
    try:
        started = time.monotonic()
        through = await client.call(
            "echo", {"busy_first": 2, "retry_after": 0.3}, deadline=Deadline.after(10)
        )
        waited = time.monotonic() - started
        # Past the deadline, the wait the tool asks for is a timeout, not an error.
        late = await client.call(
            "echo", {"busy_first": 99, "retry_after": 5}, deadline=Deadline.after(1)
        )
    finally:
        await client.close()
    assert through.status == "ok" and through.retries_429 == 2, through
    assert waited >= 0.6  # it waited the tool's Retry-After before each retry
    assert late.status == "timeout" and late.error == "backpressure past the deadline", late
    assert httpx.get(up.url + "/stats", timeout=5).json()["started"] == 4


def test_an_integer_past_the_float_range_is_a_client_error_not_a_500(upstream, gateway) -> None:
    """Before: `10**400` as a timeout (`/run_code`, `/v1/run_tests`) or as `deadline_ms` was an
    OverflowError in the gateway, a 500. Now the generic call refuses it like `1e400`, and the
    sandbox routes leave it to the tool (sandboxd answers 422 naming the field)."""
    up = upstream("echo")
    gw = gateway(
        [proxy_tool("sandbox", up.url, kind="sandbox"), proxy_tool("search", up.url, kind="search")]
    )
    huge = 10**400
    for path, body in [
        ("/run_code", {"code": "print(1)", "run_timeout": huge}),
        ("/run_code", {"code": "print(1)", "compile_timeout": huge}),
        ("/v1/run_tests", {"code": "x", "cases": [{"stdin": ""}], "timeout": huge}),
        ("/v1/run_tests", {"code": "x", "cases": [{"stdin": "", "timeout": huge}]}),
    ]:
        r = httpx.post(gw.url + path, content=json.dumps(body), timeout=10,
                       headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 200 and r.json()["body"] == body, (path, r.text)  # the echo
    r = httpx.post(gw.url + "/v1/tools/search/call", timeout=10,
                   content=json.dumps({"arguments": {}, "deadline_ms": huge}))  # fmt: skip
    assert r.status_code == 422, r.text
    assert "deadline_ms: must be a non-negative number" in r.json()["detail"]


async def test_the_rollout_client_stops_waiting_out_backpressure_without_a_deadline(
    upstream, gateway
) -> None:
    """Before: a call without a deadline (the default policies set none) retried a tool that
    answers 429 forever, forever: the rollout hung. Now the client's own timeout bounds the wait,
    as it bounds each request."""
    up = upstream("busy")
    gw = gateway([proxy_tool("echo", up.url)])
    client = GatewayClient(gw.url, default_timeout_s=1.0)
    try:
        started = time.monotonic()
        stuck = await asyncio.wait_for(
            client.call("echo", {"busy_first": 10**6, "retry_after": 0.2}), 10
        )
        waited = time.monotonic() - started
        forever = await asyncio.wait_for(
            client.call("echo", {"busy_first": 10**6, "retry_after": "inf"}), 10
        )
    finally:
        await client.close()
    assert stuck.status == "timeout" and "backpressure" in (stuck.error or ""), stuck
    assert 0.6 <= waited < 2.0
    assert forever.status == "timeout" and forever.retries_429 == 1, forever


async def test_a_caller_that_hangs_up_in_the_queue_is_logged_with_its_wait(
    upstream, gateway, caplog
) -> None:
    """Before: a call whose caller hung up while it waited for a slot logged `queue_wait_ms: 0`
    and was left out of queue_wait_seconds, as one whose deadline ran out there was."""
    caplog.set_level(logging.INFO, logger="toolenv.gateway")
    up = upstream("q")
    gw = gateway([proxy_tool("one", up.url, concurrency=1, queue=1)])
    runtime = gw.toolset.tools["one"]
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
        busy = asyncio.create_task(
            client.post("/v1/tools/one/call", json={"arguments": {"sleep_s": 1.5}})
        )
        for _ in range(400):
            if runtime.admission.in_flight == 1:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(httpx.ReadTimeout):  # waits in the queue, then hangs up
            await client.post("/v1/tools/one/call", json={"arguments": {}}, timeout=0.4)
        assert (await busy).status_code == 200
    for _ in range(100):
        gone = [vars(r) for r in caplog.records if getattr(r, "outcome", None) == "caller_gone"]
        if gone:
            break
        await asyncio.sleep(0.02)
    assert len(gone) == 1 and gone[0]["queue_wait_ms"] >= 350, gone
    text = gw.metrics_text()
    assert metric_value(text, "toolenv_gateway_queue_wait_seconds_count", tool="one") == 2
