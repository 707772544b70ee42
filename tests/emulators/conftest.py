"""The emulator service the HTTP tests share: one real server per test module, and a client
that leaves its profiles as it found them."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from emu_support import restoring_client, start_server
from testkit import ServerProcess


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = start_server("--seed", "7")
    yield s
    s.stop()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[httpx.Client]:
    with restoring_client(server) as c:
        yield c
