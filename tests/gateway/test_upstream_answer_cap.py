"""An upstream's answer is taken in up to `upstream_max_body_bytes`: past it the call is a 502
naming the tool and the cap, and the connection is closed there (before, a misbehaving upstream
could grow the gateway's memory without bound: its whole answer was buffered)."""

from __future__ import annotations

import httpx
import pytest
from gw_support import metric_value, proxy_tool

from gateway.settings import GatewaySettings
from sandboxd.settings import SandboxSettings

CAP = 4096


@pytest.mark.parametrize("chunked", [False, True])  # Content-Length; chunked (no length known)
def test_an_answer_over_the_cap_is_a_502_naming_the_tool_and_the_cap(
    upstream, gateway, chunked
) -> None:
    up = upstream("a")
    gw = gateway([proxy_tool("big", up.url)], upstream_max_body_bytes=CAP)
    r = httpx.post(
        gw.url + "/v1/tools/big/call",
        json={"arguments": {"answer_bytes": 3 * CAP, "chunked": chunked}},
        timeout=10,
    )
    assert r.status_code == 502, r.text[:300]
    answer = r.json()
    assert answer["status"] == "upstream_failed"
    assert (
        "'big'" in answer["error"] and f"upstream_max_body_bytes ({CAP} bytes)" in answer["error"]
    )
    # the pool is sound after the cut: an answer within the cap comes back whole
    r = httpx.post(
        gw.url + "/v1/tools/big/call", json={"arguments": {"answer_bytes": CAP // 2}}, timeout=10
    )
    assert r.status_code == 200 and len(r.json()["result"]["pad"]) == CAP // 2
    text = gw.metrics_text()
    assert (
        metric_value(text, "toolenv_gateway_calls_total", tool="big", outcome="upstream_failed")
        == 1
    )


def test_a_pass_through_answer_over_the_cap_is_a_502_and_never_retried(upstream, gateway) -> None:
    a, b = upstream("a"), upstream("b")
    retry = {"enabled": True, "max_attempts": 3}
    gw = gateway(
        [proxy_tool("search", a.url, b.url, kind="search", retry=retry)],
        upstream_max_body_bytes=CAP,
    )
    r = httpx.post(
        gw.url + "/retrieve", json={"queries": ["q"], "answer_bytes": 3 * CAP}, timeout=10
    )
    assert r.status_code == 502 and "upstream_max_body_bytes" in r.json()["error"], r.text[:300]
    # another upstream would answer the same call as large: one attempt only
    assert a.stats()["started"] + b.stats()["started"] == 1
    assert metric_value(gw.metrics_text(), "toolenv_gateway_retried_total", tool="search") == 0


def test_the_default_cap_leaves_room_for_sandboxds_largest_answer() -> None:
    largest_stream = SandboxSettings().max_output_bytes
    # compile and run, stdout and stderr each at the largest cap, with room for JSON escaping
    assert GatewaySettings().upstream_max_body_bytes >= 4 * 4 * largest_stream


def test_an_injected_delay_that_is_no_delay_is_left_out_of_its_histogram(upstream, gateway) -> None:
    """Before: `X-Toolenv-Injected-Delay-Ms: nan` from one answer made the histogram's sum NaN
    for good (and `-5` or `inf` bent it): only a finite, non-negative delay is one."""
    gw = gateway([proxy_tool("t", upstream("a").url)])
    for injected in ("nan", "-5", "inf", "abc", "20"):
        r = httpx.post(
            gw.url + "/v1/tools/t/call", json={"arguments": {"injected_ms": injected}}, timeout=10
        )
        assert r.status_code == 200, r.text
    text = gw.metrics_text()
    assert metric_value(text, "toolenv_gateway_injected_delay_seconds_count", tool="t") == 1
    assert metric_value(text, "toolenv_gateway_injected_delay_seconds_sum", tool="t") == 0.02
