"""A sandbox run cut at the deadline the gateway forwarded is the gateway's one `timeout`, as an
emulator's 504 is, whichever answers first: sandboxd (its TimeLimitExceeded, marked
`X-Toolenv-Deadline-Expired`) or the gateway's own timer. Before, sandboxd's answer counted as
`ok` and the generic call answered 200 status ok, while the same call cut by the gateway's timer
was a `timeout` and a 504. Real sandboxd (bubblewrap) behind a real gateway, proxied and embedded.

sandboxd's `max_deadline_s` (3 s here) caps the deadline it holds, so that on the generic call
(told the whole deadline, no reserve) sandboxd stops well before the gateway's 6 s timer: what
the gateway then answers can only come from sandboxd's answer."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
from gw_support import GatewayServer, metric_value

from gateway.settings import ToolConfig
from toolenv_core import headers as h

STARTED_THEN_HANG = "import time\nprint('started', flush=True)\ntime.sleep(30)\n"
SANDBOX_CAP_S = "3"
CALLS = "toolenv_gateway_calls_total"


def _outcome(gw: GatewayServer, outcome: str) -> float:
    return metric_value(gw.metrics_text(), CALLS, tool="sandbox", outcome=outcome)


def _captured(path: Path, count: int) -> dict[str, str]:
    """trajectory id -> captured status, once `count` records are written (off the loop)."""
    for _ in range(100):
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            break
        time.sleep(0.05)
    return {r["trajectory_id"]: r["status"] for r in map(json.loads, lines)}


def _check_cut_calls_are_timeouts(gw: GatewayServer, capture: Path) -> None:
    assert httpx.get(gw.url + "/readyz", timeout=30).status_code == 200
    with httpx.Client(base_url=gw.url, timeout=60) as c:
        # /run_code: sandboxd is told 2250 ms (the reserve) and answers before the gateway's
        # 2500 ms timer, with the output so far: its body is passed on as it came
        run = {"code": STARTED_THEN_HANG, "language": "python", "run_timeout": 30}
        r = c.post("/run_code", json=run, headers={h.DEADLINE: "2500", h.TRAJECTORY: "cut-run"})
        assert r.status_code == 200, r.text
        assert r.json()["run_result"]["status"] == "TimeLimitExceeded", r.text
        assert r.json()["run_result"]["stdout"] == "started\n", r.text  # sandboxd's, not ours
        assert _outcome(gw, "timeout") == 1 and _outcome(gw, "ok") == 0
        # the generic call: sandboxd stops at its 3 s cap, long before the gateway's 6 s
        started = time.monotonic()
        r = c.post("/v1/tools/sandbox/call", headers={h.TRAJECTORY: "cut-generic"},
                   json={"arguments": run, "deadline_ms": 6000})  # fmt: skip
        assert time.monotonic() - started < 5.0
        assert r.status_code == 504, r.text
        assert r.json()["status"] == "timeout" and r.json()["deadline_ms"] == 6000, r.text
        assert _outcome(gw, "timeout") == 2
        # the program's own run_timeout is the answer the caller asked for: ok, 200
        own = {**run, "run_timeout": 0.5}
        r = c.post("/v1/tools/sandbox/call", headers={h.TRAJECTORY: "own-generic"},
                   json={"arguments": own, "deadline_ms": 6000})  # fmt: skip
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        assert r.json()["result"]["run_result"]["status"] == "TimeLimitExceeded"
        r = c.post("/run_code", json=own, headers={h.DEADLINE: "6000", h.TRAJECTORY: "own-run"})
        assert r.json()["run_result"]["status"] == "TimeLimitExceeded", r.text
        assert _outcome(gw, "timeout") == 2 and _outcome(gw, "ok") == 2
    assert _captured(capture, 4) == {
        "cut-run": "timeout",
        "cut-generic": "timeout",
        "own-generic": "success",
        "own-run": "success",
    }


def test_a_run_the_deadline_cut_is_a_timeout_through_the_proxy(
    gateway, toolenv_server, bwrap_path, tmp_path
) -> None:
    sandboxd = toolenv_server(
        "sandboxd", "serve", env={"TOOLENV_SANDBOX_MAX_DEADLINE_S": SANDBOX_CAP_S}
    )
    capture = tmp_path / "capture.jsonl"
    tool = ToolConfig(name="sandbox", kind="sandbox", mode="proxy", upstreams=[sandboxd.url],
                      health_interval_s=0.3)  # fmt: skip
    _check_cut_calls_are_timeouts(gateway([tool], trace_path=str(capture)), capture)


def test_a_run_the_deadline_cut_is_a_timeout_with_the_embedded_sandbox(
    gateway, bwrap_path, tmp_path
) -> None:
    config = tmp_path / "toolenv.yaml"
    config.write_text(f"sandbox:\n  max_deadline_s: {SANDBOX_CAP_S}\n")
    capture = tmp_path / "capture.jsonl"
    tool = ToolConfig(name="sandbox", kind="sandbox", mode="embedded")
    gw = gateway([tool], config_file=str(config), trace_path=str(capture))
    _check_cut_calls_are_timeouts(gw, capture)
