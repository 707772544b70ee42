"""Every long-running service moves its start-up heap out of the cyclic collector's sight once
started: a full collection under load otherwise walks every framework object and stalls the
event loop (80 ms in sandboxd, once every few `/v1/run_tests` requests)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable

import pytest
from fastapi import FastAPI

from emulators.app import create_app as create_emulators_app
from emulators.settings import EmulatorSettings
from gateway.app import create_app as create_gateway_app
from gateway.settings import GatewaySettings
from sandboxd.app import create_app as create_sandbox_app
from sandboxd.settings import SandboxSettings
from toolenv_core.heap import freeze_startup_objects


def test_freezing_moves_what_exists_into_the_permanent_generation() -> None:
    gc.unfreeze()
    kept = [[] for _ in range(1000)]  # tracked containers, alive through the freeze
    freeze_startup_objects()
    try:
        assert gc.get_freeze_count() >= len(kept)
        ours = {id(k) for k in kept}
        assert not any(
            id(o) in ours for o in gc.get_objects()
        )  # in no generation the collector scans
    finally:
        gc.unfreeze()


SERVICES: dict[str, Callable[[], FastAPI]] = {
    "sandboxd": lambda: create_sandbox_app(SandboxSettings(backend="process", max_concurrency=2)),
    "emulators": lambda: create_emulators_app(EmulatorSettings()),
    "gateway": lambda: create_gateway_app(GatewaySettings(tools=[])),
}


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_a_started_service_has_frozen_its_start_up_heap(service: str, bwrap_path: str) -> None:
    app = SERVICES[service]()

    async def frozen_once_started() -> int:
        async with app.router.lifespan_context(app):
            return gc.get_freeze_count()

    gc.unfreeze()
    try:
        assert asyncio.run(frozen_once_started()) > 10_000
    finally:
        gc.unfreeze()
