"""Each service's OpenAPI document (`/openapi.json`, what `/docs` renders): one operationId per
operation, as the spec requires and client generators rely on.

Before, `/healthz` and `/readyz` took GET and HEAD on one route: two operations with one id, and
FastAPI warned (`Duplicate Operation ID readyz_readyz_get`) in the service's log at first `/docs`.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from fastapi import FastAPI

from emulators.app import create_app as emulators_app
from emulators.settings import EmulatorSettings
from gateway.app import create_app as gateway_app
from gateway.settings import GatewaySettings
from sandboxd.app import create_app as sandboxd_app
from sandboxd.settings import SandboxSettings

APPS: dict[str, Callable[[], FastAPI]] = {
    "gateway": lambda: gateway_app(GatewaySettings()),
    "sandboxd": lambda: sandboxd_app(SandboxSettings()),
    "emulators": lambda: emulators_app(EmulatorSettings()),
}


@pytest.mark.parametrize("service", sorted(APPS))
def test_every_operation_has_its_own_id(service: str) -> None:
    app = APPS[service]()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI's duplicate-id warning fails the test
        schema: dict[str, Any] = app.openapi()
    ids = Counter(op["operationId"] for path in schema["paths"].values() for op in path.values())
    assert [i for i, n in ids.items() if n > 1] == []
    assert "get" in schema["paths"]["/readyz"]  # still documented
