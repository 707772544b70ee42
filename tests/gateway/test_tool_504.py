"""A tool's 504 is the call's timeout only when the deadline the tool was told ended it.

An emulator's `error` fault with `status: 504` answers after its delay, long before the deadline:
the gateway called it `timeout`, "did not answer within the deadline", and `/retrieve` answered
the gateway's own 504 body instead of the tool's. A 504 the emulator answers at a deadline (the
caller's, or its own `max_deadline_s` before the gateway's) carries X-Toolenv-Deadline-Expired
and stays the timeout.
"""

from __future__ import annotations

import time

import httpx
from gw_support import metric_value, proxy_tool

from gateway.settings import ToolConfig

CONFIG = """emulators:
  max_deadline_s: 0.3
  search_profile:
    model:
      kind: faulty
      model: {kind: constant, value_s: 0.01}
      faults: [{type: error, rate: 1, status: 504, message: search backend timed out}]
  reward_profile:
    tool: reward
    model:
      kind: faulty
      model: {kind: constant, value_s: 0.0}
      faults: [{type: hang, rate: 1}]
"""
CALLS = "toolenv_gateway_calls_total"


def test_a_tools_own_504_before_the_deadline_is_its_error_not_a_timeout(gateway, tmp_path) -> None:
    config = tmp_path / "toolenv.yaml"
    config.write_text(CONFIG)
    gw = gateway(
        [ToolConfig(name="search", kind="search"), ToolConfig(name="reward", kind="reward")],
        config_file=str(config),
    )
    deadline = {"X-Toolenv-Deadline-Ms": "5000"}
    with httpx.Client(base_url=gw.url, timeout=10) as c:
        started = time.monotonic()
        r = c.post("/retrieve", json={"queries": ["q"]}, headers=deadline)
        assert time.monotonic() - started < 2.0
        # the tool's own status and body, as the pass-through routes promise
        assert r.status_code == 504, r.text
        assert r.json() == {"detail": "search backend timed out (injected error fault)"}
        r = c.post("/v1/tools/search/call", json={"arguments": {"query": "q"}}, headers=deadline)
        assert r.status_code == 200 and r.json()["status"] == "error", r.text
        assert "504" in r.json()["error"] and "timed out" in r.json()["result"]["detail"]
        # a hang the emulator ends at its own max_deadline_s (0.3 s of the caller's 5 s): the
        # deadline's 504, marked so, is the call's timeout
        started = time.monotonic()
        r = c.post("/v1/tools/reward/call", json={"arguments": {}}, headers=deadline)
        assert r.status_code == 504 and r.json()["status"] == "timeout", r.text
        assert 0.25 < time.monotonic() - started < 2.0
    text = gw.metrics_text()
    assert metric_value(text, CALLS, tool="search", outcome="error") == 2
    assert metric_value(text, CALLS, tool="search", outcome="timeout") == 0
    assert metric_value(text, CALLS, tool="reward", outcome="timeout") == 1


def test_an_early_504_a_hedged_call_held_is_still_the_tools(upstream, gateway) -> None:
    """A 504 held while the hedge runs (gateway.dispatch) is answered just before the deadline:
    it is the tool's early answer all the same, not the deadline's."""
    bad, hung = upstream("bad"), upstream("hung")
    hedge = {"enabled": True, "quantile": 0.5, "min_samples": 1, "min_delay_ms": 0}
    gw = gateway([proxy_tool("h", hung.url, bad.url, hedge=hedge, idempotent=True)])
    for _ in range(64):
        gw.toolset.tools["h"].window.add(0.05)  # hedge after 50 ms
    arguments = {"sleep_by": {"bad": 0.2, "hung": 30}, "status": 504, "status_on": "bad"}
    r = httpx.post(
        f"{gw.url}/v1/tools/h/call", json={"arguments": arguments, "deadline_ms": 1500}, timeout=30
    )
    assert r.status_code == 200 and r.json()["status"] == "error", r.text
    assert r.json()["result"]["upstream"] == "bad"
