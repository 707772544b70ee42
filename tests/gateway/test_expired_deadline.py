"""A call whose deadline has already run out when it arrives (`X-Toolenv-Deadline-Ms: 0`, a body
`deadline_ms` of 0, less than a millisecond) is answered by the gateway, as a deadline that runs
out in its queue, and never reaches the tool."""

from __future__ import annotations

import httpx
from gw_support import metric_value, proxy_tool


def test_an_expired_deadline_is_answered_without_calling_the_tool(upstream, gateway) -> None:
    """Before: with a pooled connection at hand, the call still went out, told 0 ms (which the
    tool reads as expired and refuses at once), before the gateway's own timer fired."""
    up = upstream("echo")
    gw = gateway([proxy_tool("echo", up.url), proxy_tool("sandbox", up.url, kind="sandbox")])
    url = gw.url + "/v1/tools/echo/call"
    assert httpx.post(url, json={"arguments": {}}, timeout=10).status_code == 200  # a warm pool
    expired = [
        ({"arguments": {}}, {"X-Toolenv-Deadline-Ms": "0"}),
        ({"arguments": {}}, {"X-Toolenv-Deadline-Ms": "0"}),
        ({"arguments": {}}, {"X-Toolenv-Deadline-Ms": "0"}),
        ({"arguments": {}, "deadline_ms": 0}, {}),
        ({"arguments": {}}, {"X-Toolenv-Deadline-Ms": "0.5"}),  # sent on, it would read as 0
    ]
    for body, headers in expired:
        r = httpx.post(url, json=body, headers=headers, timeout=10)
        assert r.status_code == 504, r.text
        answer = r.json()
        assert answer["status"] == "timeout" and "expired when the call arrived" in answer["error"]
        assert answer["deadline_ms"] == float(headers.get("X-Toolenv-Deadline-Ms", 0))
    # the sandbox route answers in its own shape, as for a deadline that ran out in the queue
    r = httpx.post(gw.url + "/run_code", json={"code": "print(1)"}, timeout=10,
                   headers={"X-Toolenv-Deadline-Ms": "0"})  # fmt: skip
    assert r.status_code == 200 and r.json()["run_result"]["status"] == "TimeLimitExceeded"
    assert r.json()["run_result"]["limit"] == "time", r.text  # as sandboxd's own says
    assert "expired when the call arrived" in r.json()["message"]
    assert up.stats()["started"] == 1  # the warm-up call only
    text = gw.metrics_text()
    assert metric_value(text, "toolenv_gateway_calls_total", tool="echo", outcome="timeout") == 5
    assert metric_value(text, "toolenv_gateway_calls_total", tool="sandbox", outcome="timeout") == 1
    assert metric_value(text, "toolenv_gateway_call_seconds_count", tool="echo") == 6
    # never admitted, as a call whose deadline ran out in the queue: no slot, no queue wait
    assert metric_value(text, "toolenv_gateway_queue_wait_seconds_count", tool="echo") == 1
    assert metric_value(text, "toolenv_gateway_queue_wait_seconds_count", tool="sandbox") == 0


def test_an_expired_deadline_is_told_back_as_it_was_sent(upstream, gateway) -> None:
    """Before: `-0` came back as `"deadline_ms": -0.0`, and the sandbox route's message rounded
    a deadline to whole milliseconds (0.5 ms read "the caller's deadline (0 ms)")."""
    up = upstream("echo")
    gw = gateway([proxy_tool("echo", up.url), proxy_tool("sandbox", up.url, kind="sandbox")])
    for body, headers in [
        ({"arguments": {}}, {"X-Toolenv-Deadline-Ms": "-0"}),
        ({"arguments": {}, "deadline_ms": -0.0}, {}),
    ]:
        r = httpx.post(gw.url + "/v1/tools/echo/call", json=body, headers=headers, timeout=10)
        assert r.status_code == 504 and '"deadline_ms": 0.0' in r.text, r.text
    r = httpx.post(gw.url + "/run_code", json={"code": "print(1)"}, timeout=10,
                   headers={"X-Toolenv-Deadline-Ms": "0.5"})  # fmt: skip
    assert "the caller's deadline (0.5 ms) expired" in r.json()["message"], r.text
    assert up.stats()["started"] == 0
