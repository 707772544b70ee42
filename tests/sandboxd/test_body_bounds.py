"""sandboxd served alone bounds a request body in size and time, as the gateway's door does.

Before, a declared body that never came held the connection with no answer (no body timeout),
and the 413 had its own words. Now `toolenv_core.bodylimit.BodyLimit` is in front of the router.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import pytest
from sbx_support import SandboxdServer

pytestmark = pytest.mark.bwrap

HEAD = "HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"


@pytest.fixture(scope="module")
def bounded(sandboxd_factory: Callable[..., SandboxdServer]) -> SandboxdServer:
    env = {"TOOLENV_SANDBOX_BODY_TIMEOUT_S": "0.5", "TOOLENV_SANDBOX_MAX_BODY_BYTES": "4096"}
    return sandboxd_factory("--backend", "process", "--max-concurrency", "2", env=env)


def _raw(server: SandboxdServer, request: bytes) -> tuple[bytes, float, bool]:
    """Send `request` on a fresh connection: the answer, how long it took, whether the server
    then closed the connection."""
    url = urlsplit(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(request)
        started = time.monotonic()
        data = b""
        while b"}" not in data and (chunk := sock.recv(65536)):
            data += chunk
        waited = time.monotonic() - started
        sock.settimeout(3)
        try:
            closed = sock.recv(65536) == b""
        except TimeoutError:
            closed = False
        return data, waited, closed


@pytest.mark.parametrize("path", ["/run_code", "/v1/run_tests"])
def test_a_declared_body_that_never_arrives_is_408_and_closes(
    bounded: SandboxdServer, path: str
) -> None:
    data, waited, closed = _raw(
        bounded, f'POST {path} {HEAD}content-length: 100\r\n\r\n{{"co'.encode()
    )
    assert data.startswith(b"HTTP/1.1 408"), data[:300]
    assert b"did not arrive within 0.5 s (4 bytes of 100)" in data, data
    assert b"connection: close" in data.lower()
    assert 0.4 <= waited < 2.0, waited
    assert closed


def test_a_declared_body_over_the_limit_is_413_at_once(bounded: SandboxdServer) -> None:
    data, waited, _ = _raw(
        bounded, f"POST /run_code {HEAD}content-length: 99999\r\n\r\n{{".encode()
    )
    assert data.startswith(b"HTTP/1.1 413"), data[:300]
    body = json.loads(data.split(b"\r\n\r\n", 1)[1])
    assert body == {"detail": "request body exceeds the limit of 4096 bytes"}
    assert waited < 0.4, waited  # before the body, not after body_timeout_s


def test_a_chunked_body_over_the_limit_is_413(bounded: SandboxdServer) -> None:
    chunk = b"x" * 5000  # no Content-Length: counted as it arrives
    request = f"POST /run_code {HEAD}transfer-encoding: chunked\r\n\r\n".encode()
    data, _, _ = _raw(bounded, request + b"%x\r\n%s\r\n0\r\n\r\n" % (len(chunk), chunk))
    assert data.startswith(b"HTTP/1.1 413"), data[:300]
    assert b"request body exceeds the limit of 4096 bytes" in data, data


def test_a_whole_body_is_served_as_always(bounded: SandboxdServer) -> None:
    out = bounded.run_code(code="print('ok')", language="python")
    assert out["status"] == "Success" and out["run_result"]["stdout"] == "ok\n"
    r = bounded.client.post(
        "/v1/run_tests",
        json={"code": "print(input())", "cases": [{"stdin": "a\n", "expected_stdout": "a\n"}]},
    )
    assert r.status_code == 200 and r.json()["verdict"] == "accepted", r.text


@pytest.mark.parametrize(
    ("line", "status"),
    [("GET /v1/ping", 200), ("GET /nope", 404), ("GET /run_code", 405), ("POST /v1/ping", 405)],
)
def test_a_declared_body_is_no_413_where_no_body_is_read(
    bounded: SandboxdServer, line: str, status: int
) -> None:
    """A route that takes no body answers as it would without the limit (it was a 413)."""
    data, _, _ = _raw(bounded, f"{line} {HEAD}content-length: 999999999\r\n\r\n".encode())
    assert data.startswith(f"HTTP/1.1 {status} ".encode()), data[:300]
