"""The front door against a caller probing it: credentials sent oddly, bodies that stall a
refusal, values the gateway cannot forward faithfully, and requests malformed at the HTTP level.
Each is refused with its own status, at once, and counted once in `refused_total`."""

from __future__ import annotations

import json
import socket
import time

from gw_support import metric_value, proxy_tool

from gateway.settings import ToolConfig

KEY = "door-key-0123456789"
AUTH = f"authorization: Bearer {KEY}\r\n"


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _head(path: str, length: int, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        f"content-length: {length}\r\n{extra}\r\n"
    ).encode()


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One Content-Length framed answer off the socket."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before an answer"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-answer"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _refused(gw, reason: str) -> float:
    gw.auth = {"authorization": f"Bearer {KEY}"}
    return metric_value(gw.metrics_text(), "toolenv_gateway_refused_total", reason=reason)


def test_a_wrong_key_is_401_at_once_whatever_body_it_declares(upstream, gateway) -> None:
    """Before: on the lane a request with a wrong key waited for its body, so one declaring a
    large body (or sending it slowly) was answered 408 after `body_timeout_s`, not 401, and
    counted twice (unauthorized and body_timeout); the app's path answered 401 at once."""
    up = upstream("a")
    gw = gateway([proxy_tool("echo", up.url)], api_keys=[KEY], body_timeout_s=5)
    sock = _connect(gw.url)
    started = time.monotonic()
    sock.sendall(_head("/v1/tools/echo/call", 100_000_000) + b"x" * 1000)
    status, headers, _ = _answer(sock)
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert time.monotonic() - started < 2.5
    sock.close()
    # the rest of a body refused at its headers is dropped as it comes, and the connection kept
    sock = _connect(gw.url)
    body = json.dumps({"arguments": {"n": 1}}).encode()
    sock.sendall(_head("/v1/tools/echo/call", len(body)) + body[:5])
    assert _answer(sock)[0] == 401  # before the rest of the body was sent
    sock.sendall(body[5:])
    sock.sendall(_head("/v1/tools/echo/call", len(body), AUTH) + body)
    status, _, answer = _answer(sock)
    assert status == 200 and json.loads(answer)["result"]["body"] == {"n": 1}
    sock.close()
    assert _refused(gw, "unauthorized") == 2 and _refused(gw, "body_timeout") == 0


def test_two_different_authorization_headers_are_refused(upstream, gateway) -> None:
    """Before: the last of two Authorization headers counted, whichever the first was (a proxy in
    front that checked the first let a caller in on the second)."""
    up = upstream("a")
    gw = gateway([proxy_tool("echo", up.url)], api_keys=[KEY, "other-key-0123456789"])
    body = json.dumps({"arguments": {}}).encode()
    cases = [  # (headers, answer): a repeat of the same value is one header
        ("authorization: Bearer wrong\r\n" + AUTH, 401),
        (AUTH + "authorization: Bearer other-key-0123456789\r\n", 401),
        (AUTH + AUTH, 200),
    ]
    for extra, expected in cases:
        sock = _connect(gw.url)
        sock.sendall(_head("/v1/tools/echo/call", len(body), extra) + body)
        status, _, answer = _answer(sock)
        sock.close()
        assert status == expected, (extra, answer)
        if status == 401:
            assert "sent twice" in json.loads(answer)["detail"]
            assert KEY not in answer.decode()
    assert _refused(gw, "unauthorized") == 2


def test_a_generic_call_never_forwards_a_number_json_cannot_carry(upstream, gateway) -> None:
    """Before: `1e400` (valid JSON) in the arguments reached the tool as `Infinity`, which is not
    JSON (a strict tool refused the call; a lenient one read infinity)."""
    up = upstream("a")
    gw = gateway([proxy_tool("echo", up.url)])
    for literal in (b"1e400", b"-1e400", b"2E+308", b"1" + b"0" * 400 + b".5"):
        body = b'{"arguments": {"x": [1, ' + literal + b'], "note": "NaN Infinity"}}'
        sock = _connect(gw.url)
        sock.sendall(_head("/v1/tools/echo/call", len(body)) + body)
        status, _, answer = _answer(sock)
        sock.close()
        assert status == 422 and "1e400" in json.loads(answer)["detail"], (literal, answer)
    assert up.stats()["started"] == 0
    # the words in a string, and numbers a float holds, go through as they were
    body = b'{"arguments": {"x": [1e300, 123456789012345678901234567890], "note": "NaN Infinity"}}'
    sock = _connect(gw.url)
    sock.sendall(_head("/v1/tools/echo/call", len(body)) + body)
    status, _, answer = _answer(sock)
    sock.close()
    assert status == 200
    assert json.loads(answer)["result"]["body"] == {
        "x": [1e300, 123456789012345678901234567890], "note": "NaN Infinity"
    }  # fmt: skip
    assert _refused(gw, "invalid_request") == 4
    # a caller's own NaN (not JSON, read as `json` reads it) goes on as it came
    body = b'{"arguments": {"x": NaN, "y": 1e400}}'
    sock = _connect(gw.url)
    sock.sendall(_head("/v1/tools/echo/call", len(body)) + body)
    assert _answer(sock)[0] == 200
    sock.close()


SMUGGLED = [  # requests the HTTP parser refuses: each one 400, counted
    b"POST /retrieve HTTP/1.1\r\nhost: t\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n"
    b"\r\n0\r\n\r\n",
    b"POST /retrieve HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\ncontent-length: 5\r\n\r\n{}",
    b"POST /retrieve HTTP/1.1\r\nhost: t\r\ncontent-length: +2\r\n\r\n{}",
    b"POST /retrieve HTTP/1.1\r\nhost: t\r\nx-trajectory-id: a\r\n b: 1\r\ncontent-length: 2\r\n\r\n{}",
    b"POST /retrieve HTTP/1.1\r\nhost: t\r\nx-step: 1\rx-turn: 2\r\ncontent-length: 2\r\n\r\n{}",
]


def test_malformed_json_and_http_are_counted_on_every_route(upstream, gateway) -> None:
    """Before: a control route's malformed JSON and a request the HTTP parser refused (the
    shapes of request smuggling) were answered 400 and counted nowhere, though `refused_total`
    says malformed JSON and a bad header or Content-Length are `invalid_request`."""
    up = upstream("a")
    gw = gateway([proxy_tool("search", up.url, kind="search")], api_keys=[KEY])
    for request in SMUGGLED:
        sock = _connect(gw.url)
        sock.sendall(request)
        assert sock.recv(65536).startswith(b"HTTP/1.1 400 "), request
        sock.close()
    sock = _connect(gw.url)
    body = b'{"tool": "search", "model":'
    sock.sendall(_head("/v1/emulators/search/profile", len(body), AUTH).replace(b"POST", b"PUT"))
    sock.sendall(body)
    status, _, answer = _answer(sock)
    sock.close()
    assert status == 400 and "not valid JSON" in json.loads(answer)["detail"]
    assert up.stats()["started"] == 0
    assert _refused(gw, "invalid_request") == len(SMUGGLED) + 1


def test_a_utf8_trajectory_id_reaches_an_embedded_tool_as_sent(gateway, upstream) -> None:
    """Before: an in-process tool got the UTF-8 of the id's Latin-1 reading (its bytes encoded
    twice), where a proxied tool got the bytes the caller sent."""
    up = upstream("a")
    gw = gateway(
        [
            ToolConfig(
                name="local", kind="http", mode="embedded", app="gw_embedded_app:create_app"
            ),
            ToolConfig(name="remote", kind="http", mode="proxy", upstreams=[up.url]),
        ]
    )
    sent = "trajé-7".encode()
    for tool in ("local", "remote"):
        body = json.dumps({"arguments": {}}).encode()
        sock = _connect(gw.url)
        head = _head(f"/v1/tools/{tool}/call", len(body), "x-trajectory-id: ID\r\n")
        sock.sendall(head.replace(b"ID", sent) + body)
        status, _, answer = _answer(sock)
        sock.close()
        assert status == 200, answer
        seen = json.loads(answer)["result"]["call_context"]["x-trajectory-id"]
        # FastAPI reads header bytes as Latin-1; the echo upstream as UTF-8
        assert seen.encode("latin-1" if tool == "local" else "utf-8") == sent, (tool, seen)
