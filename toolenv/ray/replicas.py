"""A Ray Serve replica that hosts one service's ASGI app (sandboxd, or the emulators).

The gateway calls `call(method, path, body, headers)` through the deployment handle; the request
runs in the replica's event loop against the in-process app, exactly as an embedded tool does in
the gateway. Each sandbox replica therefore owns its own process-backend pool (bubblewrap,
cgroups, run dirs) on its own node, and reaps what a dead predecessor left on that node when it
starts. Every answer says where it ran (`X-Toolenv-Node`, `X-Toolenv-Replica`).
"""

from __future__ import annotations

from typing import Any, Literal

import ray
from ray import serve

from emulators.app import create_app as create_emulators_app
from emulators.settings import EmulatorSettings
from gateway.asgi import ASGIApp, Lifespan, call_asgi, raw_headers
from sandboxd.app import create_app as create_sandbox_app
from sandboxd.settings import SandboxSettings
from toolenv_core.headers import EXECUTOR_NODE, EXECUTOR_REPLICA

Service = Literal["sandbox", "emulators"]


def build_service_app(service: Service, settings: dict[str, Any]) -> ASGIApp:
    """The service's app from the settings the driver loaded (no config file on the nodes)."""
    if service == "sandbox":
        return create_sandbox_app(SandboxSettings(**settings))
    return create_emulators_app(EmulatorSettings(**settings))


class ServiceReplica:
    """One replica: the app, its lifespan, and where it runs."""

    async def __init__(self, service: Service, settings: dict[str, Any]) -> None:
        self.service = service
        self.app = build_service_app(service, settings)
        self.lifespan = Lifespan(self.app, service)
        await self.lifespan.start()  # a failed start fails the replica: Ray retries it elsewhere
        node = f"{ray.util.get_node_ip_address()}/{ray.get_runtime_context().get_node_id()[:12]}"
        replica = serve.get_replica_context().replica_id.unique_id
        self.where = [
            (EXECUTOR_NODE.lower().encode(), node.encode()),
            (EXECUTOR_REPLICA.lower().encode(), f"{service}#{replica}".encode()),
        ]

    async def call(
        self, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """One HTTP request to the hosted app (cancelling it cancels the handler)."""
        status, out, payload = await call_asgi(
            self.app, method, path, body, raw_headers(headers), self.lifespan.state
        )
        return status, out + self.where, payload

    async def __del__(self) -> None:
        """Graceful shutdown (scale-down, redeploy): the sandbox backend releases everything."""
        await self.lifespan.stop()
