"""The tool name a live model writes reaches the gateway as the tool name, never as a path."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from testkit import LoopbackHTTP, QuietHandler

from rollout_client.gateway_client import GatewayClient


class _Recorder(QuietHandler):
    """Answers every POST 404 and keeps the raw request path it was sent."""

    paths: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.paths.append(self.path)
        self.reply(404, b'{"detail": "unknown tool"}')


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[str]]]:
    paths: list[str] = []
    handler = type("Recorder", (_Recorder,), {"paths": paths})
    with LoopbackHTTP(handler) as server:
        yield server.url, paths


@pytest.mark.parametrize(
    ("tool", "path"),
    [
        ("search", "/v1/tools/search/call"),
        # the sandbox ran a call the trajectory records as made to 'search/../sandbox'
        ("search/../sandbox", "/v1/tools/search%2F%2E%2E%2Fsandbox/call"),
        # the SandboxFusion endpoint, outside /v1/tools altogether
        ("../../../run_code?", "/v1/tools/%2E%2E%2F%2E%2E%2F%2E%2E%2Frun_code%3F/call"),
        ("..", "/v1/tools/%2E%2E/call"),
        ("search#x", "/v1/tools/search%23x/call"),  # was POST /v1/tools/search
    ],
)
async def test_a_tool_name_is_one_path_segment(recorder, tool: str, path: str) -> None:
    """Live mode takes the tool name from the model's text, and the name went into the URL as
    written: `search/../sandbox` called the sandbox, `../../../run_code?` the gateway's
    /run_code. Each is one escaped segment now, which the gateway answers as an unknown tool."""
    url, paths = recorder
    client = GatewayClient(url)
    try:
        outcome = await client.call(tool, {"query": "x"})
    finally:
        await client.close()
    assert paths == [path]
    assert outcome.status == "error" and outcome.http_status == 404
