"""Embedded mode: tools mounted in-process, their lifespans driven, cancellation reaching them."""

from __future__ import annotations

import os
import time

import gw_embedded_app
import httpx
import pytest
from gw_support import descendants, describe, metric_value

from gateway.app import create_app
from gateway.settings import GatewaySettings, ToolConfig
from gateway.toolset import custom_app


def test_embedded_tool_lifespan_deadline_and_cancellation(gateway) -> None:
    gw_embedded_app.EVENTS.clear()
    tool = ToolConfig(name="local", kind="http", mode="embedded", app="gw_embedded_app:create_app")
    gw = gateway([tool])
    assert gw_embedded_app.EVENTS == ["startup"]
    assert httpx.get(gw.url + "/readyz", timeout=5).json()["status"] == "ready"
    r = httpx.post(
        gw.url + "/v1/tools/local/call",
        json={"arguments": {"x": 1}, "deadline_ms": 4000},
        timeout=10,
    )
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.json()["result"]["echo"] == {"x": 1}
    assert 0 < float(r.json()["result"]["deadline_ms"]) <= 4000
    # a bug inside the in-process tool is its 500 answer, not a gateway failure
    r = httpx.post(gw.url + "/v1/tools/local/call", json={"arguments": {"raise": True}}, timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "error" and "500" in r.json()["error"]
    started = time.monotonic()
    r = httpx.post(gw.url + "/v1/tools/local/call", timeout=10,
                   json={"arguments": {"sleep_s": 30, "tag": "t1"}, "deadline_ms": 250})  # fmt: skip
    assert r.status_code == 504 and r.json()["status"] == "timeout"
    assert r.json()["elapsed_s"] <= 0.25 + 0.05
    assert time.monotonic() - started < 2.0
    # the cancellation reached the handler inside the in-process app
    for _ in range(40):
        if "cancelled:t1" in gw_embedded_app.EVENTS:
            break
        time.sleep(0.05)
    assert "cancelled:t1" in gw_embedded_app.EVENTS
    gw.stop()
    assert gw_embedded_app.EVENTS[-1] == "shutdown"


def test_an_in_process_status_outside_100_to_599_is_a_502(gateway) -> None:
    """As the same answer from an upstream (`toolenv_core.http1`: unparsable). Before, a
    pass-through route passed it on and the gateway's own server failed on it (a 500 and a
    traceback), and the generic call said the tool "answered HTTP 600"."""
    app = "gw_embedded_app:create_app"
    tool = ToolConfig(name="search", kind="search", mode="embedded", app=app, call_path="/call")
    gw = gateway([tool])
    for path, body in [("/retrieve", {"status": 600}),
                       ("/v1/tools/search/call", {"arguments": {"status": 600}})]:  # fmt: skip
        r = httpx.post(gw.url + path, json=body, timeout=10)
        assert r.status_code == 502 and r.json()["status"] == "upstream_failed", r.text
        assert "unparsable answer (status 600 is outside 100-599)" in r.json()["error"], r.text


def test_a_tool_whose_start_up_failed_is_unavailable_naming_why(gateway) -> None:
    """Before: calls still went to the app that never started (a 502 "failed mid-request ...
    without a complete response"), and readyz said "failed to start" twice over."""
    ref = "gw_embedded_app:create_failing_app"
    gw = gateway([ToolConfig(name="local", kind="http", mode="embedded", app=ref)])
    ready = httpx.get(gw.url + "/readyz", timeout=5)
    detail = ready.json()["detail"]
    assert ready.status_code == 503
    # the exception, not Starlette's traceback of it (the server's files, 20 lines and more)
    assert detail == (
        f"tool 'local': in-process app {ref} failed to start: "
        "RuntimeError: the tool's database is down"
    ), detail
    r = httpx.post(gw.url + "/v1/tools/local/call", json={"arguments": {}}, timeout=10)
    assert r.status_code == 503 and r.json()["status"] == "unavailable", r.text
    assert "failed to start" in r.json()["error"] and "database is down" in r.json()["error"]
    assert "Traceback" not in r.json()["error"], r.text


def test_embedded_sandbox_deadline_kills_the_program(gateway, bwrap_path) -> None:
    gw = gateway([ToolConfig(name="sandbox", kind="sandbox", mode="embedded")])
    assert httpx.get(gw.url + "/readyz", timeout=10).status_code == 200
    ok = httpx.post(
        gw.url + "/run_code", json={"code": "print(6 * 7)", "language": "python"}, timeout=30
    )
    assert ok.status_code == 200 and ok.json()["run_result"]["stdout"] == "42\n"
    before = descendants(os.getpid())
    code = "import time\nprint('started', flush=True)\ntime.sleep(60)\n"
    with httpx.Client(timeout=30) as client:
        started = time.monotonic()
        r = client.post(gw.url + "/v1/tools/sandbox/call",
                        json={"arguments": {"code": code, "language": "python", "run_timeout": 30},
                              "deadline_ms": 1500})  # fmt: skip
        waited = time.monotonic() - started
    assert r.status_code == 504 and r.json()["status"] == "timeout", r.text
    assert r.json()["elapsed_s"] <= 1.5 + 0.05
    assert waited < 3.0
    # the sleeping program (and its bwrap) are gone soon after: nothing new is left below us
    # except the idle warm sandboxes sandboxd keeps ready (it lists their pids)
    service = gw.toolset.embedded["sandboxd"].app.state.sandbox_service

    def leftover() -> set[int]:
        status = service.status()
        warm = set(status.get("warm_pids", []))
        for pid in list(warm):
            warm |= descendants(pid)
        return descendants(os.getpid()) - before - warm

    for _ in range(60):
        if not leftover() and service.status()["running"] == 0:
            break
        time.sleep(0.05)
    assert not leftover(), f"sandbox processes survived the deadline: {describe(leftover())}"
    assert service.status()["running"] == 0


def test_embedded_emulators_share_one_app_and_report_injected_delay(gateway, tmp_path) -> None:
    config = tmp_path / "toolenv.yaml"
    config.write_text(
        "emulators:\n"
        "  search_profile: {tool: search, model: {kind: constant, value_s: 0.0}}\n"
        "  reward_profile: {tool: reward, model: {kind: constant, value_s: 0.0}}\n"
    )
    trace = tmp_path / "capture.jsonl"
    gw = gateway(
        [ToolConfig(name="search", kind="search"), ToolConfig(name="reward", kind="reward")],
        config_file=str(config),
        trace_path=str(trace),
    )
    assert len(gw.toolset.embedded) == 1  # search and reward live in one emulators app
    r = httpx.post(gw.url + "/retrieve", json={"queries": ["a", "b"], "topk": 2}, timeout=10)
    assert r.status_code == 200 and len(r.json()["result"]) == 2
    assert all(len(docs) == 2 for docs in r.json()["result"])
    r = httpx.post(gw.url + "/v1/tools/search/call", timeout=10,
                   json={"arguments": {"query": "hamlet", "delay_s": 0.05}},
                   headers={"X-Trajectory-Id": "traj-1", "X-Step": "3", "X-Turn": "2"})  # fmt: skip
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.json()["result"]["result"]
    r = httpx.post(
        gw.url + "/v1/tools/reward/call", json={"arguments": {"batch_size": 4}}, timeout=10
    )
    assert r.status_code == 200 and r.json()["status"] == "ok"
    r = httpx.post(
        gw.url + "/v1/tools/reward/call", json={"arguments": {"batch_size": 0}}, timeout=10
    )
    assert r.status_code == 200 and r.json()["status"] == "error"  # the emulator's own 422
    text = gw.metrics_text()
    assert metric_value(text, "toolenv_gateway_injected_delay_seconds_count", tool="search") == 2
    assert (
        0.05
        <= metric_value(text, "toolenv_gateway_injected_delay_seconds_sum", tool="search")
        < 0.06
    )
    gw.stop()
    lines = trace.read_text().splitlines()
    assert len(lines) == 1  # only the call that carried X-Trajectory-Id


def test_the_fault_an_emulator_injected_is_named_to_the_caller(gateway, tmp_path) -> None:
    """Before: an emulator's X-Toolenv-Fault stopped at the gateway, so a caller (or `toolenv
    stress`) through it could not tell an injected error from the tool's own."""
    config = tmp_path / "toolenv.yaml"
    config.write_text(
        "emulators:\n"
        "  search_profile: {tool: search, model: {kind: faulty,\n"
        "    model: {kind: constant, value_s: 0.0},\n"
        "    faults: [{type: error, rate: 1.0, status: 503}]}}\n"
    )
    gw = gateway([ToolConfig(name="search", kind="search")], config_file=str(config))
    r = httpx.post(gw.url + "/retrieve", json={"queries": ["a"], "topk": 1}, timeout=10)
    assert (r.status_code, r.headers.get("x-toolenv-fault")) == (503, "error"), r.headers
    r = httpx.post(gw.url + "/v1/tools/search/call", json={"arguments": {"query": "a"}}, timeout=10)
    assert r.json()["status"] == "error" and r.headers.get("x-toolenv-fault") == "error"


@pytest.mark.parametrize(
    ("ref", "problem"),
    [
        ("nomodule:factory", "ModuleNotFoundError: No module named 'nomodule'"),
        ("gw_embedded_app:no_such_factory", "AttributeError: "),
    ],
)
def test_a_custom_app_that_does_not_load_is_a_settings_error(ref: str, problem: str) -> None:
    # it was imported inside the server's start-up: a traceback and exit 3
    tool = ToolConfig(name="custom", kind="http", mode="embedded", app=ref)
    with pytest.raises(ValueError) as caught:
        create_app(GatewaySettings(tools=[tool]))
    assert str(caught.value).startswith(
        f"invalid gateway settings: tool 'custom': app {ref!r} cannot be loaded: {problem}"
    )
    assert "\n" not in str(caught.value)


def test_a_custom_factory_that_returns_no_app_is_refused_naming_it() -> None:
    """Before: a factory returning something else (here None: no `return app`) started a gateway
    whose readyz said ready and whose every call to the tool was a 502 TypeError."""
    with pytest.raises(TypeError, match=r"^tool app 'gw_embedded_app:no_app' returned NoneType, "):
        custom_app("gw_embedded_app:no_app")
    assert callable(custom_app("gw_embedded_app:create_app"))


@pytest.mark.parametrize(
    ("factory", "why"),
    [
        ("raising_factory", "RuntimeError: the tool's config file is missing"),
        ("no_app", "TypeError: tool app 'gw_embedded_app:no_app' returned NoneType, not an ASGI"),
    ],
)
def test_a_custom_factory_that_fails_leaves_its_tool_unavailable_naming_why(
    gateway, factory, why
) -> None:
    """Before: the factory's exception went up through the gateway's start-up, a 40-line
    traceback and exit 3, the other tools never served; an app whose own start-up fails is a
    503 naming why (docs/gateway.md), and so now is one whose factory fails."""
    ref = f"gw_embedded_app:{factory}"
    gw = gateway(
        [
            ToolConfig(name="broken", kind="http", mode="embedded", app=ref),
            ToolConfig(name="fine", kind="http", mode="embedded", app="gw_embedded_app:create_app"),
        ]
    )
    ready = httpx.get(gw.url + "/readyz", timeout=5)
    assert ready.status_code == 503, ready.text
    detail = ready.json()["detail"]
    assert detail.startswith(f"tool 'broken': in-process app {ref} failed to start: {why}"), detail
    r = httpx.post(gw.url + "/v1/tools/broken/call", json={"arguments": {}}, timeout=10)
    assert r.status_code == 503 and r.json()["status"] == "unavailable", r.text
    # not "no upstream reachable (tool 'broken': ...)": an in-process tool has no upstream
    said = f"tool 'broken' is unavailable: its in-process app {ref} failed to start: {why}"
    assert r.json()["error"].startswith(said), r.text
    r = httpx.post(gw.url + "/v1/tools/fine/call", json={"arguments": {"x": 1}}, timeout=10)
    assert r.status_code == 200 and r.json()["result"]["echo"] == {"x": 1}, r.text
