"""Small real HTTP servers with known behaviour, to check that the generator measures truly.

Run one as a separate process (uvicorn, httptools, uvloop) so it never shares a core or an event
loop with the generator:

    python -m stress.testing --kind uniform --low-ms 200 --high-ms 300 --port 9000

Kinds:
- `zero`: answers at once (the bench's zero-delay endpoint);
- `uniform`: sleeps a seeded Uniform(low, high) ms per request (a known latency profile), and
  says how long in `X-Toolenv-Injected-Delay-Ms`;
- `stall`: answers at once, except that every `period` seconds it stalls for `stall` seconds
  (like a GC pause): requests arriving in the stall are all held until it ends.
Paths: `/readyz`; `/chunked` (a chunked body); `/close` (answers with Connection: close);
`/status/<code>`; anything else is the normal answer.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from toolenv_core.headers import INJECTED_DELAY
from toolenv_core.net import free_port

DELAY_HEADER = INJECTED_DELAY.lower().encode()


def make_app(
    kind: str = "zero",
    *,
    low_ms: float = 0.0,
    high_ms: float = 0.0,
    seed: int = 0,
    period_s: float = 5.0,
    stall_s: float = 1.0,
) -> Any:
    """A raw ASGI app (no framework overhead, so the server is never the bottleneck)."""
    rng = random.Random(seed)
    t0 = time.monotonic()
    body = b'{"ok":true}'

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        while (await receive()).get("more_body"):
            pass
        delay_ms = 0.0
        if path != "/readyz":
            if kind == "uniform":
                delay_ms = rng.uniform(low_ms, high_ms)
                await asyncio.sleep(delay_ms / 1000.0)
            elif kind == "stall":
                phase = (time.monotonic() - t0) % period_s
                if phase >= period_s - stall_s:
                    delay_ms = (period_s - phase) * 1000.0
                    await asyncio.sleep(period_s - phase)
        status = 200
        if path.startswith("/status/"):
            status = int(path.rsplit("/", 1)[1])
        headers = [
            (b"content-type", b"application/json"),
            (DELAY_HEADER, f"{delay_ms:.3f}".encode()),
        ]
        if path == "/chunked":
            await send({"type": "http.response.start", "status": status, "headers": headers})
            for part in (b'{"parts":[', b"1,2,", b"3]}"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        if path == "/close":
            headers.append((b"connection", b"close"))
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=["zero", "uniform", "stall"], default="zero")
    parser.add_argument("--low-ms", type=float, default=0.0)
    parser.add_argument("--high-ms", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--period-s", type=float, default=5.0)
    parser.add_argument("--stall-s", type=float, default=1.0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cpu", type=int, default=None, help="pin this server to one CPU")
    args = parser.parse_args(argv)
    if args.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.cpu})

    app = make_app(
        args.kind,
        low_ms=args.low_ms,
        high_ms=args.high_ms,
        seed=args.seed,
        period_s=args.period_s,
        stall_s=args.stall_s,
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        backlog=4096,
        timeout_keep_alive=60,
    )


@contextmanager
def serve(
    kind: str = "zero", *, cpu: int | None = None, timeout_s: float = 30.0, **options: Any
) -> Iterator[str]:
    """Start a test server in its own process; yield its base URL; stop it afterwards."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "stress.testing",
        "--kind",
        kind,
        "--port",
        str(port),
    ]
    for key, value in options.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    if cpu is not None:
        argv += ["--cpu", str(cpu)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, port, timeout_s)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(proc: subprocess.Popen[bytes], port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RuntimeError(f"test server exited with {proc.returncode}: {err}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
                s.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"test server on port {port} not ready within {timeout_s} s")


if __name__ == "__main__":
    main()


__all__ = ["make_app", "serve"]
