"""Every request the gateway refuses before a tool is counted in /metrics, whichever path serves it.

Before: only the 401 and the rate-limit 429 were; malformed JSON, a bad header, a generic call's
body, an unknown tool, a body over the limit or too slow were answered and neither counted nor
logged, so a client whose every call was refused left the gateway's metrics reading idle.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from gw_support import metric_value, proxy_tool

REFUSED = "toolenv_gateway_refused_total"


def _send(url: str, raw: bytes) -> int:
    """One raw request on its own connection; the status it was answered (0: none)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(raw)
        data = b""
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                return 0
            data += chunk
    return int(data.split(b" ", 2)[1])


def _post(path: str, body: bytes, extra: str = "", chunked: bool = False) -> bytes:
    if chunked:  # no Content-Length: the app's path (PassThrough), not the lane
        framed = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
        head = f"POST {path} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n{extra}\r\n"
        return head.encode() + framed
    head = f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


@pytest.mark.parametrize("chunked", [False, True], ids=["lane", "app"])
def test_each_refusal_before_a_tool_is_counted_by_reason(upstream, gateway, chunked) -> None:
    up = upstream("a")
    gw = gateway([proxy_tool("echo", up.url)], max_body_bytes=4096, body_timeout_s=0.5)
    args = json.dumps({"arguments": {"n": 1}}).encode()
    sent = {
        "invalid_request": [
            _post("/v1/tools/echo/call", b"{not json", chunked=chunked),
            _post("/v1/tools/echo/call", args, "x-step: -1\r\n", chunked=chunked),
            _post("/v1/tools/echo/call", b'{"args": {}}', chunked=chunked),  # 422
        ],
        "unknown_tool": [_post("/v1/tools/nope/call", args, chunked=chunked)],
        "too_large": [_post("/v1/tools/echo/call", b"x" * 5000, chunked=chunked)],
    }
    statuses = [_send(gw.url, raw) for raws in sent.values() for raw in raws]
    assert statuses == [400, 400, 422, 404, 413], statuses
    # a body that never arrives whole: 408 after body_timeout_s
    head = b"POST /v1/tools/echo/call HTTP/1.1\r\nhost: t\r\n"
    late = head + (
        b"transfer-encoding: chunked\r\n\r\n5\r\n{" if chunked else b"content-length: 50\r\n\r\n{"
    )
    assert _send(gw.url, late) == 408
    ok = httpx.post(gw.url + "/v1/tools/echo/call", content=args, timeout=10)
    assert ok.status_code == 200 and ok.json()["status"] == "ok"
    text = gw.metrics_text()
    expected = {reason: len(raws) for reason, raws in sent.items()}
    expected |= {"body_timeout": 1, "unauthorized": 0, "rate_limited": 0}
    counted = {reason: metric_value(text, REFUSED, reason=reason) for reason in expected}
    assert counted == expected, text
    # none of them is a call of the tool; the one call that reached it is
    assert metric_value(text, "toolenv_gateway_calls_total", tool="echo", outcome="ok") == 1
    assert up.stats()["started"] == 1
