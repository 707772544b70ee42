"""Every service bounds a request's head: a huge one is a 431, a slow or missing one a 408 or a
close, each in time and without holding the server's memory or connections; and reads pipelined
requests no faster than it answers them (real subprocesses
on loopback: `toolenv serve`, `toolenv sandboxd serve`, `toolenv emulators serve`)."""

from __future__ import annotations

import json
import select
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from testkit import ServerProcess, free_port

from toolenv_core.headbound import HEAD_TIMEOUT_S, MAX_HEAD_BYTES

SERVICES = [("serve",), ("sandboxd", "serve"), ("emulators", "serve")]


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=HEAD_TIMEOUT_S + 5)


def _read_to_close(sock: socket.socket) -> bytes:
    """Everything the server writes until it closes (a timeout here fails the test)."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def _answer(raw: bytes) -> tuple[int, dict[str, str], dict[str, str]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The three services, started once for the module (in parallel: each takes seconds)."""
    started: list[ServerProcess] = []
    for args in SERVICES:
        port = free_port()
        argv = [sys.executable, "-m", "toolenv", *args, "--host", "127.0.0.1", "--port", str(port)]
        started.append(ServerProcess(argv, f"http://127.0.0.1:{port}"))
    threads = [threading.Thread(target=s.start, args=("/readyz",)) for s in started]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    yield dict(zip(SERVICES, started, strict=True))
    for server in started:
        server.stop()


@pytest.mark.parametrize("service", SERVICES, ids=" ".join)
def test_a_head_over_the_limit_is_431_and_the_service_still_answers(servers, service) -> None:
    url = servers[service].url
    with _connect(url) as sock:
        # before: a 200 MB header was read whole (300 MB of RSS) and answered 200
        sock.sendall(b"GET /readyz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (MAX_HEAD_BYTES + 1))
        status, headers, body = _answer(_read_to_close(sock))
    assert status == 431
    assert headers["connection"] == "close"
    assert body == {
        "detail": f"the request line and headers exceed the limit of {MAX_HEAD_BYTES} bytes; "
        "the connection is closed"
    }
    assert httpx.get(url + "/readyz", timeout=5).status_code == 200


def test_idle_and_trickled_heads_are_closed_in_time(servers) -> None:
    """Before: both were held open for ever (a few thousand take every fd the process has)."""
    results: dict[tuple[tuple[str, ...], str], tuple[float, bytes]] = {}

    def idle(service: tuple[str, ...]) -> None:
        with _connect(servers[service].url) as sock:
            start = time.monotonic()
            raw = _read_to_close(sock)
            results[service, "idle"] = (time.monotonic() - start, raw)

    def trickle(service: tuple[str, ...]) -> None:
        with _connect(servers[service].url) as sock:
            start = time.monotonic()
            sock.sendall(b"GET /readyz HTTP/1.1\r\n")
            # a header line that never ends, a byte at a time until the server answers
            while time.monotonic() - start < HEAD_TIMEOUT_S + 3:
                if select.select([sock], [], [], 0.5)[0]:
                    break
                sock.sendall(b"x")
            sock.settimeout(2)
            results[service, "trickle"] = (time.monotonic() - start, _read_to_close(sock))

    threads = [
        threading.Thread(target=probe, args=(service,))
        for service in SERVICES
        for probe in (idle, trickle)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HEAD_TIMEOUT_S + 15)
    for service in SERVICES:
        waited, raw = results[service, "idle"]
        assert raw == b"", service  # nothing was asked: closed without an answer
        assert HEAD_TIMEOUT_S - 0.5 < waited < HEAD_TIMEOUT_S + 3, service
        waited, raw = results[service, "trickle"]
        status, headers, body = _answer(raw)
        assert (status, headers["connection"]) == (408, "close"), service
        assert body["detail"] == (
            f"the request line and headers did not arrive within {HEAD_TIMEOUT_S:g} s; "
            "the connection is closed"
        )
        assert waited < HEAD_TIMEOUT_S + 3, service


def test_a_body_answered_before_its_end_is_not_awaited_for_ever(servers) -> None:
    """Before: a request answered before its body was whole (an unknown path's 404 here; the
    gateway's 401 to a wrong key alike) kept its connection while the rest of the body trickled
    in, for ever: no key needed to hold every connection the process can have."""
    results: dict[tuple[str, ...], tuple[float, bytes]] = {}

    def trickle(service: tuple[str, ...]) -> None:
        with _connect(servers[service].url) as sock:
            start = time.monotonic()
            sock.sendall(b"POST /nope HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
            got = b""
            while time.monotonic() - start < HEAD_TIMEOUT_S + 5:
                if select.select([sock], [], [], 0.5)[0]:
                    chunk = sock.recv(65536)
                    if not chunk:
                        break
                    got += chunk
                try:
                    sock.sendall(b"1\r\nx\r\n")
                except OSError:  # closed: a reset, as the rest of the body was never read
                    break
            results[service] = (time.monotonic() - start, got)

    threads = [threading.Thread(target=trickle, args=(service,)) for service in SERVICES]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HEAD_TIMEOUT_S + 15)
    for service in SERVICES:
        waited, got = results[service]
        assert got.startswith(b"HTTP/1.1 404 "), (service, got)
        assert HEAD_TIMEOUT_S - 0.5 < waited < HEAD_TIMEOUT_S + 3, (service, waited)


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("service", SERVICES, ids=" ".join)
def test_pipelining_without_reading_answers_holds_no_memory(servers, service) -> None:
    """Before: each answer let another read in, the queue of parsed requests grew as fast as the
    client sent (+700 MB in 10 s)."""
    server = servers[service]
    request = b"GET /readyz HTTP/1.1\r\nhost: x\r\n\r\n"
    with _connect(server.url) as sock:  # answered in order, all of them
        sock.sendall(request * 3 + b"GET /readyz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert _read_to_close(sock).count(b"HTTP/1.1 200 OK") == 4
    before = _rss_mb(server.proc.pid)
    burst = memoryview(request * 1000)
    with _connect(server.url) as sock:
        sock.setblocking(False)
        end, pending = time.monotonic() + 5, burst
        while time.monotonic() < end:
            try:
                pending = pending[sock.send(pending) :] or burst
            except BlockingIOError:
                time.sleep(0.005)
        grown = _rss_mb(server.proc.pid) - before
    assert grown < 100, f"{grown:.0f} MB more"
    assert httpx.get(server.url + "/readyz", timeout=5).status_code == 200


def test_the_gateway_lane_waits_for_a_client_that_does_not_read(servers) -> None:
    """Before: the lane wrote every answer whatever the client had read, so one that sent
    requests and never read grew the gateway's memory by each answer (a megabyte here)."""
    server = servers["serve",]
    body = json.dumps({"code": "print('x' * 1_000_000)", "language": "python"}).encode()
    head = b"POST /run_code HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    request = head + b"content-length: %d\r\n\r\n" % len(body) + body
    before = _rss_mb(server.proc.pid)
    with _connect(server.url) as sock:
        sock.settimeout(1)
        for _ in range(150):
            try:
                sock.sendall(request)
            except TimeoutError:
                break  # the gateway stopped reading: what the fix does
            time.sleep(0.02)
        time.sleep(3)  # the runs sent finish
        grown = _rss_mb(server.proc.pid) - before
    assert grown < 60, f"{grown:.0f} MB more"
