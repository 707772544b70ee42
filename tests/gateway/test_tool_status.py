"""A tool's error answer through the generic call is a 200 (`"status": "error"`); the answer says
its status in `X-Toolenv-Tool-Status` as well, and `toolenv stress` counts those as `tool_error`
(a run whose every call was the tool's 422 was reported 100% ok, exit 0)."""

from __future__ import annotations

import json

import httpx
from gw_support import proxy_tool
from typer.testing import CliRunner

from stress import LoadSpec, run_load
from stress.cli import EXIT_ALL_FAILED, build_app
from toolenv_core import headers as h


def test_the_generic_call_says_its_status_in_a_header(upstream, gateway) -> None:
    gw = gateway([proxy_tool("echo", upstream("a").url)])
    for arguments, status in (({"x": 1}, "ok"), ({"status": 422}, "error")):
        r = httpx.post(f"{gw.url}/v1/tools/echo/call", json={"arguments": arguments}, timeout=10)
        assert r.status_code == 200 and r.json()["status"] == status, r.text
        assert r.headers[h.TOOL_STATUS] == status


def test_stress_counts_a_tools_error_answers_as_errors(upstream, gateway) -> None:
    gw = gateway([proxy_tool("echo", upstream("a").url)])
    url = f"{gw.url}/v1/tools/echo/call"
    bodies = [{"arguments": {"status": 422}}, {"arguments": {"x": 1}}]  # cycled: half and half
    result = run_load(LoadSpec(url=url, bodies=bodies, arrival="closed", concurrency=1,
                               max_requests=6, duration_s=10, timeout_s=5))  # fmt: skip
    summary = result.summary()
    assert {k: v["count"] for k, v in summary["outcomes"].items()} == {"ok": 3, "tool_error": 3}
    assert summary["status_counts"] == {"200": 6} and summary["error_rate"] == 0.5
    assert [r.outcome for r in result.records] == ["tool_error", "ok"] * 3
    assert all(r.headers == {} for r in result.records)  # read, not kept unless asked for

    out = CliRunner().invoke(
        build_app(),
        ["--gateway", gw.url, "--tool", "echo", "--arguments", '{"status": 422}', "--rate", "20",
         "--duration", "0.25s", "--quiet", "--json", "--records", "--capture-header",
         h.TOOL_STATUS],
    )  # fmt: skip
    assert out.exit_code == EXIT_ALL_FAILED, out.output
    report = json.loads(out.stdout)
    assert set(report["outcomes"]) == {"tool_error"} and report["throughput"] == 0
    assert report["records"][0]["headers"] == {h.TOOL_STATUS: "error"}
