"""Gateway test fixtures: start real upstreams and gateways, stop them after the test."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from gw_support import GatewayServer, Upstream

from gateway.settings import GatewaySettings, ToolConfig


@pytest.fixture
def upstream() -> Iterator[Any]:
    started: list[Upstream] = []

    def start(name: str = "u", unhealthy: bool = False, keep_alive_s: float = 5.0) -> Upstream:
        up = Upstream(name, unhealthy, keep_alive_s=keep_alive_s)
        started.append(up)
        return up

    yield start
    for up in started:
        up.kill()


@pytest.fixture
def gateway() -> Iterator[Any]:
    started: list[GatewayServer] = []

    def start(
        tools: list[ToolConfig], config_file: str | None = None, **settings: Any
    ) -> GatewayServer:
        server = GatewayServer(GatewaySettings(tools=tools, **settings), config_file=config_file)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
