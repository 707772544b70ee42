"""schemathesis against the gateway's own OpenAPI: no generated request may cause a 5xx."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from gw_support import GatewayServer, Upstream
from hypothesis import HealthCheck, given, settings

from gateway.settings import GatewaySettings, ToolConfig


@pytest.fixture(scope="module")
def gateway_schema() -> Iterator[object]:
    up = Upstream("fuzz", plain=True)
    tools = [
        ToolConfig(name=name, kind=kind, mode="proxy", upstreams=[up.url])
        for name, kind in (("sandbox", "sandbox"), ("search", "search"), ("reward", "reward"))
    ]
    gw = GatewayServer(GatewaySettings(tools=tools, max_body_bytes=64 * 1024))
    try:
        yield schemathesis.openapi.from_url(gw.url + "/openapi.json")
    finally:
        gw.stop()
        up.kill()


def test_no_generated_request_causes_a_server_error(gateway_schema) -> None:
    """A few dozen generated requests per route (bounded), each must answer below 500.

    Driven through hypothesis directly (not schemathesis' pytest plugin, which does not load
    under this pytest); the upstream is a plain echo so every 5xx would be the gateway's own.
    """
    failures: list[str] = []
    operations = [result.ok() for result in gateway_schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/run_code",
        "/retrieve",
        "/v1/run_tests",
        "/v1/tools/{tool}/call",
    }
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None
        )
        def check(case) -> None:
            response = case.call(timeout=10)
            if response.status_code == 504 and _asked_for_tiny_deadline(case):
                return  # the documented answer to a deadline the echo cannot meet
            if response.status_code >= 500:
                failures.append(
                    f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:200]}"
                )

        check()
    assert not failures, "\n".join(failures[:10])


def _asked_for_tiny_deadline(case) -> bool:
    values = [(case.headers or {}).get("X-Toolenv-Deadline-Ms")]
    if isinstance(case.body, dict):
        values.append(case.body.get("deadline_ms"))
    for value in values:
        try:
            if value is not None and float(value) < 100:
                return True
        except (TypeError, ValueError):
            continue
    return False
