"""The lean HTTP/1.1 client and interim (1xx) answers, for both of its owners: a load run's
`LoadClient` and the gateway's upstream `Pool` (a real loopback server on raw sockets)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import pytest
from testkit import raw_tcp_server

from stress import LoadSpec, run_load
from toolenv_core.http1_pool import ConnectionBroken, Pool

# RFC 9110 15.2: a client must parse any number of 1xx answers before the final one, even
# unasked. Each request gets two interim answers, then its final answer numbered by request.
INTERIM = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n"


@pytest.fixture()
def interim_server() -> Iterator[str]:
    """Answers each request on a connection with 100, 103, then `200` and body `n` (the n-th
    request on that connection), keep-alive."""

    def serve_connection(conn: socket.socket, stop: threading.Event) -> None:
        with conn:
            n, pending = 0, b""
            while not stop.is_set():
                while b"\r\n\r\n" not in pending:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    pending += chunk
                head, pending = pending.split(b"\r\n\r\n", 1)
                length = next(
                    (
                        int(h.split(b":")[1])
                        for h in head.split(b"\r\n")
                        if h.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                while len(pending) < length:
                    pending += conn.recv(65536)
                pending = pending[length:]
                n += 1
                body = str(n).encode()
                conn.sendall(
                    INTERIM
                    + b"HTTP/1.1 200 OK\r\nX-N: %s\r\nContent-Length: %d\r\n\r\n%s"
                    % (body, len(body), body)
                )

    with raw_tcp_server(serve_connection) as url:
        yield url


def test_a_load_run_counts_the_final_answer_not_an_interim_one(interim_server: str) -> None:
    # every request was "http_100" (exit 4), and the real answers were dropped unread
    spec = LoadSpec(
        url=interim_server + "/x",
        arrival="closed",
        concurrency=1,
        max_requests=4,
        duration_s=5,
        timeout_s=2,
        capture_headers=["X-N", "Link"],
    )
    result = run_load(spec)
    assert result.summary()["status_counts"] == {"200": 4}
    # one connection, each request with its own final answer (not its predecessor's)
    assert [r.headers for r in result.records] == [{"X-N": str(n)} for n in (1, 2, 3, 4)]


def test_an_upstream_call_returns_the_final_answer(interim_server: str) -> None:
    async def calls() -> list[tuple[int, bytes]]:
        pool = Pool(interim_server, connect_timeout_s=2, keepalive_s=30)
        try:
            out = []
            for _ in range(3):
                response = await asyncio.wait_for(pool.request("POST", "/x", {}, b"{}"), 5)
                out.append((response.status, response.body))
            return out
        finally:
            pool.close()

    assert asyncio.run(calls()) == [(200, b"1"), (200, b"2"), (200, b"3")]


@pytest.mark.parametrize("status", [b"600", b"999", b"099"])
def test_a_status_outside_100_to_599_is_an_unparsable_answer(status: bytes) -> None:
    """RFC 9110 15: such a line is no HTTP status. Before, it was taken as one: the gateway
    passed 600 on and its server failed on it (a 500 and a traceback), and "099" (read as 99)
    counted as a success."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 %s Odd\r\ncontent-length: 2\r\n\r\n{}" % status)
        await writer.drain()

    async def call() -> BaseException:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Pool(f"http://127.0.0.1:{port}", connect_timeout_s=2, keepalive_s=30)
        try:
            with pytest.raises(ConnectionBroken) as caught:
                await asyncio.wait_for(pool.request("GET", "/x", {}, b""), 5)
            return caught.value
        finally:
            pool.close()
            server.close()

    assert str(asyncio.run(call())) == "unparsable answer"
