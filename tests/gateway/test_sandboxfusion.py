"""SandboxFusion's semantics through the real gateway and a real sandbox (bubblewrap): deadlines
derived from the request's own timeouts, a caller's deadline answered in SandboxFusion's shape,
control routes, and a Ctrl-C that drains calls in flight without signalling the programs."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gateway.sandboxfusion import request_budget_ms
from gateway.settings import ToolConfig
from toolenv_core import headers as h

PRINT_SLEEP_PRINT = "import time\nprint('before', flush=True)\ntime.sleep({s})\nprint('after')\n"
STARTED_THEN_HANG = "import time\nprint('started', flush=True)\ntime.sleep(30)\n"


def _run_code(
    url: str, code: str, headers: dict[str, str] | None = None, **fields
) -> httpx.Response:
    body = {"code": code, "language": "python", **fields}
    return httpx.post(url + "/run_code", json=body, headers=headers or {}, timeout=60)


def _assert_time_limit(r: httpx.Response, stdout: str) -> None:
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "Failed", body
    assert body["run_result"]["status"] == "TimeLimitExceeded", body
    assert body["run_result"]["stdout"] == stdout, body


@pytest.fixture
def sandbox_gateway(gateway, bwrap_path):
    def start(**tool) -> object:
        gw = gateway([ToolConfig(name="sandbox", kind="sandbox", **tool)])
        assert httpx.get(gw.url + "/readyz", timeout=30).status_code == 200
        return gw

    return start


def test_no_deadline_header_the_request_bounds_itself(sandbox_gateway) -> None:
    # a tool default far below the run: SandboxFusion semantics ignore it on /run_code
    gw = sandbox_gateway(default_deadline_ms=800, timeout_margin_ms=2000)
    r = _run_code(gw.url, PRINT_SLEEP_PRINT.format(s=1.5), run_timeout=3)
    assert r.status_code == 200 and r.json()["status"] == "Success", r.text
    assert r.json()["run_result"]["stdout"] == "before\nafter\n"
    cases = {"code": PRINT_SLEEP_PRINT.format(s=1.2), "language": "python",
             "cases": [{"expected_stdout": "before\nafter\n"}], "timeout": 3}  # fmt: skip
    r = httpx.post(gw.url + "/v1/run_tests", json=cases, timeout=60)
    assert r.status_code == 200 and r.json()["verdict"] == "accepted", r.text
    # the generic call keeps the tool's default (and its documented 504)
    r = httpx.post(gw.url + "/v1/tools/sandbox/call", timeout=60,
                   json={"arguments": {"code": PRINT_SLEEP_PRINT.format(s=1.5), "run_timeout": 3}})  # fmt: skip
    assert r.status_code == 504 and r.json()["deadline_ms"] == 800


def test_absent_timeouts_are_the_embedded_sandboxs_own_defaults(
    gateway, bwrap_path, tmp_path
) -> None:
    """They were SandboxFusion's 10 s each whatever the sandbox applied: with its
    `default_run_timeout_s: 30`, a 22 s run that sent no run_timeout was cut at 25 s, "the
    request deadline ended it" (a deadline the caller never sent)."""
    cfg = tmp_path / "toolenv.yaml"
    cfg.write_text("sandbox:\n  default_compile_timeout_s: 4\n  default_run_timeout_s: 30\n")
    tools = [ToolConfig(name="sandbox", kind="sandbox"),
             ToolConfig(name="own", kind="sandbox", default_run_timeout_s=2)]  # fmt: skip
    gw = gateway(tools, config_file=str(cfg))
    config = gw.toolset.tools["sandbox"].config
    assert (config.default_compile_timeout_s, config.default_run_timeout_s) == (4, 30)
    own = gw.toolset.tools["own"].config  # a tool's own setting stands
    assert (own.default_compile_timeout_s, own.default_run_timeout_s) == (4, 2)
    assert request_budget_ms("/run_code", {"code": "1"}, config) == (4 + 30) * 1000 + 5000
    cases = {"cases": [{}, {"timeout": 1}], "timeout": "3"}
    assert request_budget_ms("/v1/run_tests", cases, own) == (4 + 3 + 1) * 1000 + 5000
    r = _run_code(gw.url, "print(1)")
    assert r.status_code == 200 and r.json()["status"] == "Success", r.text


def test_timeouts_sent_as_numeric_strings_bound_the_request_too(sandbox_gateway) -> None:
    """sandboxd reads `"run_timeout": "3"` as 3 s, as SandboxFusion does; the gateway read it as
    no timeout at all and cut the run at the tool's default deadline (0.8 s here, 30 s by
    default) with TimeLimitExceeded."""
    gw = sandbox_gateway(default_deadline_ms=800, timeout_margin_ms=2000)
    r = _run_code(gw.url, PRINT_SLEEP_PRINT.format(s=1.5), run_timeout="3", compile_timeout="1")
    assert r.status_code == 200 and r.json()["status"] == "Success", r.text
    cases = {"code": PRINT_SLEEP_PRINT.format(s=1.2), "language": "python",
             "cases": [{"expected_stdout": "before\nafter\n", "timeout": "3"}], "timeout": "3"}  # fmt: skip
    r = httpx.post(gw.url + "/v1/run_tests", json=cases, timeout=60)
    assert r.status_code == 200 and r.json()["verdict"] == "accepted", r.text


def test_a_boolean_timeout_is_a_422_through_the_gateway(sandbox_gateway) -> None:
    """Before: `run_timeout: true` ran with a 1-second limit. sandboxd says what to fix and the
    gateway passes its 422 on; the same numbers as ints and floats still run."""
    gw = sandbox_gateway()
    r = _run_code(gw.url, "print(1)", run_timeout=True)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["run_timeout"]
    assert r.json()["detail"][0]["msg"].startswith("must be a number, not true")
    for run_timeout in (1, 2.5):
        r = _run_code(gw.url, "print(1)", run_timeout=run_timeout, memory_limit_MB=256)
        assert r.status_code == 200 and r.json()["status"] == "Success", r.text


def test_a_callers_deadline_answers_in_sandboxfusions_shape_with_the_output(
    sandbox_gateway,
) -> None:
    gw = sandbox_gateway()
    started = time.monotonic()
    r = _run_code(gw.url, STARTED_THEN_HANG, {h.DEADLINE: "1500"}, run_timeout=30)
    assert time.monotonic() - started < 2.5
    _assert_time_limit(r, "started\n")
    body = {"code": STARTED_THEN_HANG, "language": "python", "cases": [{}, {}], "timeout": 30}
    r = httpx.post(gw.url + "/v1/run_tests", json=body, headers={h.DEADLINE: "1500"}, timeout=60)
    assert r.status_code == 200 and r.json()["verdict"] == "time_limit", r.text


def test_a_deadline_spent_in_the_gateways_queue_keeps_the_shape(sandbox_gateway) -> None:
    gw = sandbox_gateway(concurrency=1, queue=8, timeout_margin_ms=0)
    with ThreadPoolExecutor(2) as pool:
        busy = pool.submit(_run_code, gw.url, PRINT_SLEEP_PRINT.format(s=2), run_timeout=5)
        time.sleep(0.5)  # the slot is taken
        started = time.monotonic()
        r = _run_code(gw.url, "print(1)", {h.DEADLINE: "500"})
        waited = time.monotonic() - started
        # no deadline header: it was said to be "the caller's deadline (300 ms)", never sent
        own = _run_code(gw.url, "print(1)", run_timeout=0.2, compile_timeout=0.1)
        assert own.json()["message"].startswith(
            "the request's own bound (300 ms: its compile_timeout + run_timeout + the tool's "
            "timeout_margin_ms) expired at the gateway: "
        ), own.text
        queued = httpx.post(gw.url + "/v1/tools/sandbox/call", headers={h.DEADLINE: "300"},
                            json={"arguments": {"code": "print(1)"}}, timeout=30)  # fmt: skip
        assert busy.result().json()["status"] == "Success"
    _assert_time_limit(r, "")
    assert r.json()["message"].startswith("the caller's deadline (500 ms) expired"), r.text
    assert waited < 1.5
    assert queued.status_code == 504 and queued.json()["status"] == "timeout"


def test_sandbox_control_through_the_embedded_gateway(sandbox_gateway) -> None:
    gw = sandbox_gateway()
    assert httpx.get(gw.url + "/v1/ping", timeout=10).json() == "pong"
    status = httpx.get(gw.url + "/v1/sandbox/status", timeout=10)
    assert status.status_code == 200 and status.json()["backend"] == "process", status.text
    # docs/sandboxd.md lists it with the other routes "through the gateway": it was a 404
    languages = httpx.get(gw.url + "/v1/languages", timeout=10)
    assert languages.status_code == 200, languages.text
    names = {lang["name"] for lang in languages.json()["languages"]}
    assert names == {"bash", "c", "cpp", "python"}, languages.text


def test_sandbox_semantics_and_control_through_the_proxy_gateway(
    gateway, toolenv_server, bwrap_path
) -> None:
    sandboxd = toolenv_server("sandboxd", "serve")
    gw = gateway([ToolConfig(name="sandbox", kind="sandbox", mode="proxy",
                             upstreams=[sandboxd.url], health_interval_s=0.3)])  # fmt: skip
    assert httpx.get(gw.url + "/v1/ping", timeout=10).json() == "pong"
    assert httpx.get(gw.url + "/v1/sandbox/status", timeout=10).json()["backend"] == "process"
    r = _run_code(gw.url, STARTED_THEN_HANG, {h.DEADLINE: "1500"}, run_timeout=30)
    _assert_time_limit(r, "started\n")


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_stopping_toolenv_serve_drains_calls_in_flight(toolenv_server, bwrap_path, how) -> None:
    server = toolenv_server("serve", timeout=120)
    result: dict[str, httpx.Response] = {}

    def call() -> None:
        result["r"] = _run_code(server.url, PRINT_SLEEP_PRINT.format(s=2), run_timeout=10)

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.8)  # the program is running
    assert server.proc is not None
    if how == "ctrl-c":  # what a terminal does: SIGINT to the whole foreground process group
        os.killpg(server.proc.pid, signal.SIGINT)
    else:
        server.proc.send_signal(signal.SIGTERM)
    caller.join(30)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "Success", r.json()  # not "Failed, signal 2"
    assert r.json()["run_result"]["stdout"] == "before\nafter\n"
    # a clean exit; on SIGTERM the service reports, as a process should, that SIGTERM ended it
    assert server.proc.wait(30) == (0 if how == "ctrl-c" else -signal.SIGTERM)
