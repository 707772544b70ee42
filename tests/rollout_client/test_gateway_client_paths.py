"""The tool name a live model writes reaches the gateway as the tool name, never as a path."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from rollout_client.gateway_client import GatewayClient


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers every POST 404 and keeps the raw request path it was sent."""

    paths: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.paths.append(self.path)
        body = b'{"detail": "unknown tool"}'
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[str]]]:
    paths: list[str] = []
    handler = type("Recorder", (_Recorder,), {"paths": paths})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", paths
    server.shutdown()
    server.server_close()


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
