"""Helpers the test modules import directly (fixtures live in conftest.py).

Import them as `from testkit import ...`: every test folder has its own conftest.py, and a bare
`from conftest import ...` resolves to whichever of those pytest happened to load first.
"""

from __future__ import annotations

import http.server
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx

from toolenv_core.net import free_port

__all__ = ["LoopbackHTTP", "QuietHandler", "ServerProcess", "free_port", "raw_tcp_server"]


class ServerProcess:
    """A real server started as a subprocess on loopback, stopped with SIGINT."""

    def __init__(self, argv: list[str], url: str, env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.url = url
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_path: str = "/readyz", timeout: float = 60.0) -> ServerProcess:
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode(errors="replace") if self.proc.stdout else ""
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{out}")
            try:
                if httpx.get(self.url + ready_path, timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server at {self.url} not ready within {timeout} s")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 15.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def output(self) -> str:
        return (
            self.proc.stdout.read().decode(errors="replace")
            if self.proc and self.proc.stdout
            else ""
        )


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """A `LoopbackHTTP` handler: `reply` sends one whole answer, and nothing is logged."""

    def reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class LoopbackHTTP:
    """A tiny upstream a test controls: the stdlib's threaded HTTP server on 127.0.0.1 (a free
    port) answering with `handler`, served from a daemon thread while the `with` block runs."""

    def __init__(self, handler: type[http.server.BaseHTTPRequestHandler]) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> LoopbackHTTP:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop serving and close the port (again: a no-op)."""
        self.server.shutdown()
        self.server.server_close()


@contextmanager
def raw_tcp_server(serve: Callable[[socket.socket, threading.Event], None]) -> Iterator[str]:
    """A server on 127.0.0.1 for answers no HTTP library would send: each accepted connection
    goes to `serve(conn, stop)` on a thread of its own (`stop` is set when the block ends).
    Yields `http://127.0.0.1:PORT`; stops accepting and closes the port at the end."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.1)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            threading.Thread(target=serve, args=(conn, stop), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        listener.close()
