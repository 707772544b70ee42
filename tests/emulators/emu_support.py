"""A real `toolenv emulators serve` for the emulator tests, and a client that leaves its profiles
as it found them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from testkit import ServerProcess, free_port

from toolenv_core import headers

FAST = {"model": {"kind": "constant", "value_s": 0.0}}
# the emulators' answer headers, lower-case as a raw answer's parsed headers are
INJECTED = headers.INJECTED_DELAY.lower()
FAULT = headers.FAULT.lower()
TIMER = headers.TIMER_ERROR.lower()
LEAD = headers.PACING_LEAD.lower()


def start_server(*args: str) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "toolenv", "emulators", "serve", "--host", "127.0.0.1"]
    argv += ["--port", str(port), *args]
    return ServerProcess(argv, f"http://127.0.0.1:{port}").start("/readyz", timeout=60)


@contextmanager
def restoring_client(server: ServerProcess) -> Iterator[httpx.Client]:
    """A client; every profile is put back as it was when it closes."""
    with httpx.Client(base_url=server.url, timeout=30) as c:
        before = {t: c.get(f"/v1/emulators/{t}/profile").json() for t in ("search", "reward")}
        yield c
        for tool, profile in before.items():
            assert c.put(f"/v1/emulators/{tool}/profile", json=profile).status_code == 200
