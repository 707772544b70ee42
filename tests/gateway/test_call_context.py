"""The call contract through a real gateway: the call-context headers reach every tool (embedded
and proxy), the deadline rule (header and body: the earlier wins), a call without a deadline,
and how the rollout client reads a timeout."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.settings import ToolConfig
from rollout_client.gateway_client import GatewayClient
from toolenv_core import headers as h
from toolenv_core.deadline import Deadline

CUSTOM = "gw_embedded_app:create_app"
CONTEXT = {h.TRAJECTORY: "traj-7", h.STEP: "4", h.TURN: "2"}
WANT = {"x-trajectory-id": "traj-7", "x-step": "4", "x-turn": "2"}
DRIFT_CONFIG = """emulators:
  search_profile:
    tool: search
    model:
      kind: drift
      by: step
      schedule:
        - {start: 0, model: {kind: constant, value_s: 0.01}}
        - {start: 3, model: {kind: constant, value_s: 0.03}}
  reward_profile: {tool: reward, model: {kind: constant, value_s: 0.0}}
"""


def _context_seen(gw_url: str, tool: str, path: str = "") -> dict[str, str | None]:
    r = httpx.post(
        f"{gw_url}/v1/tools/{tool}/call", json={"arguments": {"x": 1}}, headers=CONTEXT, timeout=10
    )
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    return r.json()["result"]["call_context"]


def test_call_context_headers_reach_embedded_and_proxied_tools(gateway, upstream) -> None:
    up = upstream("a")
    gw = gateway(
        [
            ToolConfig(name="local", kind="http", mode="embedded", app=CUSTOM),
            ToolConfig(name="remote", kind="http", mode="proxy", upstreams=[up.url]),
        ]
    )
    assert _context_seen(gw.url, "local") == WANT
    assert _context_seen(gw.url, "remote") == WANT
    # nothing sent, nothing invented
    r = httpx.post(gw.url + "/v1/tools/local/call", json={"arguments": {}}, timeout=10)
    assert r.json()["result"]["call_context"] == dict.fromkeys(WANT)


def test_the_generic_call_sends_its_arguments_as_json_whatever_the_envelope_said(
    gateway, upstream
) -> None:
    """The gateway writes the tool's body itself (`arguments`, as JSON) but passed on the content
    type of the caller's envelope: `curl -d` says a form, and a FastAPI tool answered 422."""
    up = upstream("a")
    gw = gateway([ToolConfig(name="remote", kind="http", mode="proxy", upstreams=[up.url])])
    data = b'{"arguments": {"x": 1}}'
    for sent in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {"content-type": sent} if sent else {}
        r = httpx.post(gw.url + "/v1/tools/remote/call", content=data, headers=headers, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["result"]["content_type"] == "application/json", sent


def _injected_ms(url: str, step: str) -> str:
    r = httpx.post(url + "/retrieve", json={"queries": ["q"]}, headers={h.STEP: step}, timeout=10)
    assert r.status_code == 200, r.text
    return r.headers[h.INJECTED_DELAY]


def test_a_drifting_profile_sees_the_step_through_the_embedded_gateway(gateway, tmp_path) -> None:
    config = tmp_path / "toolenv.yaml"
    config.write_text(DRIFT_CONFIG)
    gw = gateway([ToolConfig(name="search", kind="search")], config_file=str(config))
    assert [_injected_ms(gw.url, s) for s in ("0", "2", "3", "9")] == [
        "10.000",
        "10.000",
        "30.000",
        "30.000",
    ]
    # the generic call forwards the step too (the metric sums what the emulator injected)
    r = httpx.post(gw.url + "/v1/tools/search/call", json={"arguments": {"query": "q"}},
                   headers={h.STEP: "5"}, timeout=10)  # fmt: skip
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_a_drifting_profile_sees_the_step_through_the_proxy_gateway(
    gateway, toolenv_server, tmp_path
) -> None:
    config = tmp_path / "toolenv.yaml"
    config.write_text(DRIFT_CONFIG)
    emulators = toolenv_server("emulators", "serve", "--config", str(config))
    gw = gateway([ToolConfig(name="search", kind="search", mode="proxy",
                             upstreams=[emulators.url])])  # fmt: skip
    assert [_injected_ms(gw.url, s) for s in ("1", "3")] == ["10.000", "30.000"]


def test_header_and_body_deadline_the_earlier_wins(gateway) -> None:
    gw = gateway([ToolConfig(name="local", kind="http", mode="embedded", app=CUSTOM)])
    url = gw.url + "/v1/tools/local/call"
    slow = {"sleep_s": 5}
    for header_ms, body_ms in ((300, 5000), (5000, 300)):
        r = httpx.post(url, json={"arguments": slow, "deadline_ms": body_ms},
                       headers={h.DEADLINE: str(header_ms)}, timeout=10)  # fmt: skip
        assert r.status_code == 504 and r.json()["status"] == "timeout", r.text
        assert r.json()["deadline_ms"] == 300
        assert r.json()["elapsed_s"] < 1.0
    # the tool sees the budget it was granted (the earlier one), never more
    r = httpx.post(url, json={"arguments": {}, "deadline_ms": 8000},
                   headers={h.DEADLINE: "2000"}, timeout=10)  # fmt: skip
    assert 0 < float(r.json()["result"]["deadline_ms"]) <= 2000
    # a malformed header is a clear 400 even with a body deadline
    r = httpx.post(url, json={"arguments": {}, "deadline_ms": 100},
                   headers={h.DEADLINE: "soon"}, timeout=10)  # fmt: skip
    assert r.status_code == 400 and h.DEADLINE in r.json()["detail"]


async def test_a_call_without_deadline_is_not_sent_as_expired(gateway) -> None:
    gw = gateway([ToolConfig(name="local", kind="http", mode="embedded", app=CUSTOM,
                             default_deadline_ms=20_000)])  # fmt: skip
    client = GatewayClient(gw.url)
    try:
        outcome = await client.call(
            "local", {"sleep_s": 0.05}, deadline=Deadline.never(), trajectory_id="t", step=1
        )
    finally:
        await client.close()
    assert outcome.status == "ok", outcome
    # no deadline header went out: the tool got the gateway's default budget, not "0"
    assert 19_000 < float(outcome.result["deadline_ms"]) <= 20_000
    assert outcome.result["call_context"]["x-step"] == "1"
    with pytest.raises(ValueError):
        Deadline.never().to_header_value()


async def test_the_rollout_client_reads_a_timeout_from_the_status_and_body(
    gateway, tmp_path
) -> None:
    config = tmp_path / "toolenv.yaml"
    config.write_text(DRIFT_CONFIG)
    gw = gateway(
        [ToolConfig(name="search", kind="search"), ToolConfig(name="reward", kind="reward")],
        config_file=str(config),
    )
    client = GatewayClient(gw.url)
    try:
        # the emulator answers its own 504 at the forwarded deadline, a moment before the
        # gateway's timer: the caller still sees one structured timeout
        late, error = await asyncio.gather(
            client.call("search", {"query": "q", "delay_s": 5}, deadline=Deadline.after(0.3)),
            client.call("reward", {"batch_size": 0}, deadline=Deadline.after(5)),
        )
    finally:
        await client.close()
    assert late.status == "timeout" and late.http_status == 504, late
    assert "deadline" in (late.error or "")
    assert late.elapsed_s < 2.0
    # a tool's own error (its 422) stays an error, not a timeout
    assert error.status == "error" and error.http_status == 200, error


def test_a_header_sent_twice_with_different_values_is_a_400_naming_it(gateway) -> None:
    """The last one counted: two deadlines (a proxy's and the caller's, say) ran to the later,
    two trajectory ids recorded the call under one of them."""
    gw = gateway([ToolConfig(name="local", kind="http", mode="embedded", app=CUSTOM)])
    url = gw.url + "/v1/tools/local/call"
    for name, values in ((h.DEADLINE, ("100", "5000")), (h.TRAJECTORY, ("traj-1", "traj-2"))):
        sent = [(name, value) for value in values]
        r = httpx.post(url, json={"arguments": {}}, headers=sent, timeout=10)
        assert r.status_code == 400, r.text
        assert r.json()["detail"] == f"{name} was sent twice with different values: send it once"
    same = [(h.TRAJECTORY, "traj-1"), (h.TRAJECTORY, "traj-1")]  # a repeat says one thing
    r = httpx.post(url, json={"arguments": {}}, headers=same, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["result"]["call_context"]["x-trajectory-id"] == "traj-1"
