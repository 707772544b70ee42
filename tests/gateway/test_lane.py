"""The connection-level lane (gateway.lane) on real sockets: what HTTP/1.1 lets a client do to a
hot route, answered in order and in full whichever path (lane or app) serves each request."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest
from gw_support import GatewayServer, metric_value, proxy_tool

from gateway.dispatch import Expiry
from gateway.settings import GatewaySettings

KEY = "lane-key-0123456789"


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _post(path: str, body: dict, extra: str = "", version: str = "1.1") -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/{version}\r\nhost: t\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n{extra}\r\n"
    )
    return head.encode() + data


def _read_responses(sock: socket.socket, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    """`count` responses read off the socket in order (Content-Length framed, as the gateway
    frames every answer)."""
    buf = b""
    out = []
    while len(out) < count:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed after {len(out)} responses"
            buf += chunk
        head, _, buf = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers["content-length"])
        while len(buf) < length:
            chunk = sock.recv(65536)
            assert chunk, "connection closed mid-body"
            buf += chunk
        out.append((status, headers, buf[:length]))
        buf = buf[length:]
    return out


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_pipelined_calls_are_answered_in_order(upstream, gateway) -> None:
    up = upstream("a")
    gw = gateway([proxy_tool("echo", up.url)])
    sock = _connect(gw.url)
    # a slow hot call, a fast one, a framework route and another hot call, in one write
    sock.sendall(
        _post("/v1/tools/echo/call", {"arguments": {"n": 1, "sleep_s": 0.3}}, "x-request-id: r1\r\n")
        + _post("/v1/tools/echo/call", {"arguments": {"n": 2}}, "x-request-id: r2\r\n")
        + b"GET /healthz HTTP/1.1\r\nhost: t\r\nx-request-id: r3\r\n\r\n"
        + _post("/v1/tools/echo/call", {"arguments": {"n": 4}}, "x-request-id: r4\r\n")
    )  # fmt: skip
    answers = _read_responses(sock, 4)
    assert [a[1]["x-request-id"] for a in answers] == ["r1", "r2", "r3", "r4"]
    assert [a[0] for a in answers] == [200, 200, 200, 200]
    assert json.loads(answers[0][2])["result"]["body"]["n"] == 1
    assert json.loads(answers[1][2])["result"]["body"]["n"] == 2
    assert json.loads(answers[2][2]) == {"status": "ok"}
    assert json.loads(answers[3][2])["result"]["body"]["n"] == 4
    # the connection stays open for more
    sock.sendall(_post("/v1/tools/echo/call", {"arguments": {"n": 5}}))
    (status, headers, body), = _read_responses(sock, 1)  # fmt: skip
    assert status == 200 and json.loads(body)["result"]["body"]["n"] == 5
    assert headers["content-type"] == "application/json" and headers["x-request-id"]
    sock.close()


def test_bodies_without_length_and_expect_continue_take_the_app_path_alike(
    upstream, gateway
) -> None:
    up = upstream("a")
    gw = gateway([proxy_tool("echo", up.url)], max_body_bytes=4096)
    sock = _connect(gw.url)
    data = json.dumps({"arguments": {"n": 7}}).encode()
    chunked = (
        b"POST /v1/tools/echo/call HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"%x\r\n" % 5 + data[:5] + b"\r\n" + b"%x\r\n" % (len(data) - 5) + data[5:] + b"\r\n0\r\n\r\n"
    )  # fmt: skip
    sock.sendall(chunked)
    (status, _, body), = _read_responses(sock, 1)  # fmt: skip
    assert status == 200 and json.loads(body)["result"]["body"] == {"n": 7}
    # a chunked body over the limit: 413 from the app's guard, as for a declared length
    big = json.dumps({"arguments": {"x": "y" * 5000}}).encode()
    sock.sendall(
        b"POST /v1/tools/echo/call HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(big) + big + b"\r\n0\r\n\r\n"
    )  # fmt: skip
    (status, _, body), = _read_responses(sock, 1)  # fmt: skip
    assert status == 413 and "4096" in json.loads(body)["detail"]
    sock.close()
    r = httpx.post(
        gw.url + "/retrieve", json={"queries": ["q"]}, headers={"Expect": "100-continue"}, timeout=5
    )
    assert r.status_code == 404  # no search tool: said, not hung
    r = httpx.post(gw.url + "/v1/tools/echo/call", json={"arguments": {"n": 8}},
                   headers={"Expect": "100-continue"}, timeout=5)  # fmt: skip
    assert r.status_code == 200 and r.json()["result"]["body"] == {"n": 8}


def test_connection_close_and_http10_end_the_connection_after_the_answer(upstream, gateway) -> None:
    up = upstream("a")
    gw = gateway([proxy_tool("echo", up.url)])
    sock = _connect(gw.url)
    sock.sendall(_post("/v1/tools/echo/call", {"arguments": {"n": 1}}, "connection: close\r\n"))
    (status, headers, _), = _read_responses(sock, 1)  # fmt: skip
    assert status == 200 and headers["connection"] == "close"
    assert _closed(sock)
    sock = _connect(gw.url)
    sock.sendall(_post("/v1/tools/echo/call", {"arguments": {"n": 2}}, version="1.0"))
    (status, _, body), = _read_responses(sock, 1)  # fmt: skip
    assert status == 200 and json.loads(body)["result"]["body"] == {"n": 2}
    assert _closed(sock)


def test_refusals_on_the_lane_drain_the_body_and_keep_the_connection(upstream, gateway) -> None:
    up = upstream("a")
    gw = gateway([proxy_tool("echo", up.url)], api_keys=[KEY], max_body_bytes=2048)
    sock = _connect(gw.url)
    sock.sendall(_post("/v1/tools/echo/call", {"arguments": {"n": 1}}, "x-request-id: no-key\r\n"))
    (status, headers, body), = _read_responses(sock, 1)  # fmt: skip
    assert status == 401 and headers["www-authenticate"] == "Bearer"
    assert json.loads(body)["request_id"] == "no-key" == headers["x-request-id"]
    auth = f"authorization: Bearer {KEY}\r\n"
    # a route that reads its body (with no search tool, /retrieve reads none: its 404 now)
    sock.sendall(_post("/v1/tools/nope/call", {"arguments": {"q": "x" * 4000}}, auth))
    (status, _, body), = _read_responses(sock, 1)  # fmt: skip
    assert status == 413 and "2048" in json.loads(body)["detail"]
    sock.sendall(_post("/retrieve", {"queries": ["x" * 4000]}, auth))
    (status, _, body), = _read_responses(sock, 1)  # fmt: skip
    assert status == 404 and "search" in json.loads(body)["detail"]
    sock.sendall(_post("/v1/tools/echo/call", {"arguments": {"n": 3}}, auth))
    (status, _, body), = _read_responses(sock, 1)  # fmt: skip
    assert status == 200 and json.loads(body)["result"]["body"] == {"n": 3}
    assert json.loads(body)["result"]["authorization"] is None
    sock.close()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])  # the lane; the app's path
def test_front_door_refusals_are_json_whichever_path(upstream, gateway, framing) -> None:
    """Before: the lane's 401 and 429 carried no content type (the app's path said JSON)."""
    up = upstream("a")
    gw = gateway(
        [proxy_tool("echo", up.url)], api_keys=[KEY], rate_limit_per_s=0.001, rate_limit_burst=1
    )
    frame = _chunked if framing == "chunked" else _post
    auth = f"authorization: Bearer {KEY}\r\n"
    sock = _connect(gw.url)
    sock.sendall(frame("/v1/tools/echo/call", {"arguments": {}}))  # no key
    sock.sendall(frame("/v1/tools/echo/call", {"arguments": {}}, auth))
    sock.sendall(frame("/v1/tools/echo/call", {"arguments": {}}, auth))  # over the burst of 1
    answers = _read_responses(sock, 3)
    assert [a[0] for a in answers] == [401, 200, 429]
    for _, headers, body in answers:
        assert headers["content-type"] == "application/json", headers
        assert json.loads(body)
    sock.close()
    # counted where an operator looks (before, a refused request was in no metric at all)
    gw.auth = {"authorization": f"Bearer {KEY}"}
    text = gw.metrics_text()
    for reason in ("unauthorized", "rate_limited"):
        assert metric_value(text, "toolenv_gateway_refused_total", reason=reason) == 1, text
    assert metric_value(text, "toolenv_gateway_calls_total", tool="echo", outcome="ok") == 1


def test_shutdown_answers_the_call_in_flight_then_closes(upstream, gateway) -> None:
    up = upstream("a")
    gw = gateway([proxy_tool("echo", up.url)])
    sock = _connect(gw.url)
    sock.sendall(_post("/v1/tools/echo/call", {"arguments": {"sleep_s": 0.5}}))
    time.sleep(0.2)  # the call is at the upstream
    stopper = threading.Thread(target=gw.stop)
    stopper.start()
    (status, headers, body), = _read_responses(sock, 1)  # fmt: skip
    stopper.join(timeout=15)
    assert status == 200 and json.loads(body)["status"] == "ok"
    assert headers.get("connection") == "close"
    assert _closed(sock)


def test_keep_alive_closes_idle_connections_only(upstream) -> None:
    up = upstream("a")
    gw = GatewayServer(GatewaySettings(tools=[proxy_tool("echo", up.url)]), keep_alive_s=0.6)
    try:
        sock = _connect(gw.url)
        for n in range(8):  # busy for longer than the keep-alive: never idle that long
            sock.sendall(_post("/v1/tools/echo/call", {"arguments": {"n": n}}))
            (status, _, body), = _read_responses(sock, 1)  # fmt: skip
            assert status == 200 and json.loads(body)["result"]["body"] == {"n": n}
            idle = time.monotonic()
            time.sleep(0.2 if n < 7 else 0)
        assert _closed(sock)
        assert 0.55 <= time.monotonic() - idle <= 3.0
    finally:
        gw.stop()


def test_expiry_is_asyncio_timeout() -> None:
    async def main() -> None:
        with pytest.raises(TimeoutError):
            async with Expiry(0.05):
                await asyncio.sleep(5)
        async with Expiry(5):
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)  # nothing left pending on the task
        outer = asyncio.ensure_future(_sleep_in_expiry())
        await asyncio.sleep(0.05)
        outer.cancel()  # a cancellation from elsewhere stays a cancellation
        with pytest.raises(asyncio.CancelledError):
            await outer
        async with Expiry(-1) as gone:  # already expired: cancelled at the first await
            pass
        assert gone.handle is not None
        with pytest.raises(TimeoutError):
            async with Expiry(0):
                await asyncio.sleep(1)

    asyncio.run(main())


async def _sleep_in_expiry() -> None:
    async with Expiry(5):
        await asyncio.sleep(5)


def test_each_request_is_charged_once_by_the_rate_limit_whichever_path(upstream, gateway) -> None:
    up = upstream("a")
    gw = gateway([proxy_tool("echo", up.url)], rate_limit_per_s=0.001, rate_limit_burst=3)
    sock = _connect(gw.url)
    data = json.dumps({"arguments": {"n": 1}}).encode()
    chunked = (
        b"POST /v1/tools/echo/call HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"%x\r\n" % len(data) + data + b"\r\n0\r\n\r\n"
    )  # fmt: skip
    sock.sendall(chunked)  # the app's path
    sock.sendall(_post("/v1/tools/echo/call", {"arguments": {"n": 2}}))  # the lane
    sock.sendall(chunked)
    sock.sendall(_post("/v1/tools/echo/call", {"arguments": {"n": 4}}))  # over the burst of 3
    answers = _read_responses(sock, 4)
    assert [a[0] for a in answers] == [200, 200, 200, 429]
    assert answers[3][1]["retry-after"]
    sock.close()


def _chunked(path: str, body: dict, extra: str = "") -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n{extra}\r\n".encode()
    return head + b"%x\r\n" % len(data) + data + b"\r\n0\r\n\r\n"


@pytest.mark.parametrize("framing", ["content-length", "chunked"])  # the lane; the app's path
def test_a_caller_that_hangs_up_ends_its_call(upstream, gateway, request, framing) -> None:
    """Before: the call went on without anyone to answer, holding its tool's slot until the tool
    finished (a sandboxed program ran to its run_timeout, up to a minute, after an RL client
    aborted the rollout that asked for it)."""
    up = upstream("slow")
    gw = gateway(
        [proxy_tool("search", up.url, kind="search", max_deadline_ms=60_000, concurrency=2)]
    )
    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append  # type: ignore[method-assign]
    # where an app's exception is logged (after the server set up its logging)
    logging.getLogger("uvicorn.error").addHandler(handler)
    request.addfinalizer(lambda: logging.getLogger("uvicorn.error").removeHandler(handler))
    encode = _post if framing == "content-length" else _chunked
    calls = [
        ("/retrieve", {"sleep_s": 30}),
        ("/v1/tools/search/call", {"arguments": {"sleep_s": 30}}),
    ]
    for path, body in calls:
        sock = _connect(gw.url)
        sock.sendall(encode(path, body))
        for _ in range(100):  # until the upstream has the call
            if up.stats()["started"] > calls.index((path, body)):
                break
            time.sleep(0.02)
        sock.close()
    for _ in range(100):
        if up.stats()["abandoned"] == 2:
            break
        time.sleep(0.02)
    assert up.stats() | {"deadline_ms": None} == {
        "started": 2, "finished": 0, "abandoned": 2, "deadline_ms": None,
    }  # fmt: skip
    runtime = gw.toolset.tools["search"]
    assert runtime.admission.in_flight == 0  # the slots are free again
    assert runtime.m.outcomes["caller_gone"].value == 2  # and counted (they were in no outcome)
    assert not errors, [record.getMessage() for record in errors]
