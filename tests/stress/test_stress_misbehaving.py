"""`toolenv stress` against loopback servers that break HTTP/1.1 in one way each."""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from cli_support import invoke
from testkit import raw_tcp_server

from stress import LoadSpec, run_load


@contextmanager
def raw_server(answer: Callable[[socket.socket], bool]) -> Iterator[str]:
    """A keep-alive server on 127.0.0.1 that reads each request head and calls `answer(conn)`,
    which writes what it likes and returns False to close the connection."""

    def serve_one(conn: socket.socket, stop: threading.Event) -> None:
        conn.settimeout(0.2)
        with conn:
            data = b""
            while not stop.is_set():
                try:
                    chunk = conn.recv(65536)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not chunk:
                    return
                data += chunk
                while b"\r\n\r\n" in data:  # stress's bodies here are empty: heads only
                    _, data = data.split(b"\r\n\r\n", 1)
                    if not answer(conn):
                        return

    with raw_tcp_server(serve_one) as url:
        yield url + "/"


def test_bytes_past_a_content_length_do_not_crash_the_run() -> None:
    """A 200 declaring 2 bytes and sending 5: the 3 extra broke the parser of a connection that
    was already idle, which was dropped but left in the idle list; the next request was written
    to its closed transport and the whole run died (RuntimeError: the handler is closed)."""

    def overlong(conn: socket.socket) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokXYZ")
        return True

    with raw_server(overlong) as url:
        spec = LoadSpec(url=url, method="GET", rate=40, duration_s=0.5, timeout_s=1, connections=2)
        result = run_load(spec)
    outcomes = result.summary()["outcomes"]
    assert sum(o["count"] for o in outcomes.values()) == 20  # each request accounted for
    assert set(outcomes) <= {"ok", "protocol_error"}, outcomes


def test_bytes_past_an_answer_are_not_blamed_on_the_next_request() -> None:
    """Closed loop on one connection: each answer's 3 extra bytes came in the read that ended
    it, the next request was sent on it from inside that read, and the parser then failed on
    the extra bytes with that request on the wire: every second request a `protocol_error` in
    microseconds, for an answer the server never gave it. The connection is reused only once
    its read is parsed; broken, it is dropped and the request goes on a fresh one."""

    def overlong(conn: socket.socket) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokXYZ")
        return True

    with raw_server(overlong) as url:
        spec = LoadSpec(url=url, method="GET", arrival="closed", concurrency=2,
                        max_requests=40, duration_s=5, timeout_s=1)  # fmt: skip
        result = run_load(spec)
    assert result.summary()["outcomes"].keys() == {"ok"}, result.summary()["outcomes"]
    assert result.n == 40


def test_an_answer_that_is_not_http_is_no_silence() -> None:
    """A server answering each request at once with a malformed status line: the table showed
    `protocol_error` in under a millisecond, and the verdict under it was "the target never
    answered", exit 3 (what a refused connection says). It answered: exit 4, with what it got."""

    def garbage(conn: socket.socket) -> bool:
        conn.sendall(b"HTTP/1.1 2x0 OK\r\nContent-Length: 2\r\n\r\nok")
        return True

    with raw_server(garbage) as url:
        result = invoke("--url", url, "--rate", "40", "--duration", "0.25s", "--quiet")
    assert result.exit_code == 4, result.output
    assert "never answered" not in result.output
    assert "not one request succeeded (protocol_error 10)" in result.output


def test_a_switching_protocols_answer_is_counted_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 101 (a WebSocket endpoint, say): httptools raises `HttpParserUpgrade` past it, which
    escaped the connection's `data_received`: one "Fatal error on transport" traceback on stderr
    per request. The answer is counted as what it is and its connection closed."""

    def upgrade(conn: socket.socket) -> bool:
        conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                     b"Connection: Upgrade\r\n\r\n\x81\x02hi")  # fmt: skip
        return True

    caplog.set_level(logging.ERROR)
    with raw_server(upgrade) as url:
        spec = LoadSpec(url=url, method="GET", rate=40, duration_s=0.25, timeout_s=1)
        result = run_load(spec)
    assert result.summary()["status_counts"] == {"101": 10}
    assert set(result.summary()["outcomes"]) == {"http_101"}
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_ctrl_c_while_preconnecting_to_a_target_that_never_accepts() -> None:
    """`--preconnect` to a listener whose accept queue is full: each connect waits out its
    `--timeout`, and Ctrl-C was not heard until they had (30 s here) before exiting 130."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)  # one queued connection, never accepted; the rest wait
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/"
        timer = threading.Timer(1.0, signal.raise_signal, (signal.SIGINT,))
        timer.start()
        began = time.monotonic()
        args = ["--rate", "10", "--duration", "5s", "--timeout", "30s", "--preconnect", "8"]
        result = invoke("--url", url, *args, "--quiet")
        took = time.monotonic() - began
        timer.join()
    assert result.exit_code == 130, result.output
    assert took < 5, took


def test_an_endless_header_is_cut_off_not_kept() -> None:
    """A head that never ends (one header's value, a MiB at a time): httptools grew that value by
    concatenation until the request's timeout (memory without bound, CPU quadratic in it), and
    the request was a `timeout`. Past `MAX_HEAD_BYTES` the answer is unparsable, at once."""

    def endless(conn: socket.socket) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nX-Big: ")
        chunk = b"a" * (1 << 20)
        try:
            for _ in range(200):  # 200 MiB at most, as long as the client reads
                conn.sendall(chunk)
        except OSError:
            pass
        return False

    with raw_server(endless) as url:
        spec = LoadSpec(url=url, method="GET", rate=10, duration_s=0.2, timeout_s=3)
        result = run_load(spec)
    assert set(result.summary()["outcomes"]) == {"protocol_error"}, result.summary()["outcomes"]
    assert result.latencies_ms("protocol_error").max() < 1500
