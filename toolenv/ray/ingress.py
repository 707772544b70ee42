"""The gateway as a Ray Serve ingress: the same app `toolenv serve` runs, with the sandbox and
emulator tools bound to deployment handles instead of in-process apps.

Every gateway behaviour (admission with 429 + Retry-After, deadlines forwarded to the replica,
hedging and retries, metrics, trace capture) is the gateway's own code; only the backend differs.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from gateway.app import create_app
from gateway.asgi import ASGIApp
from gateway.ray_backend import RayBackend
from gateway.settings import GatewaySettings

# Which deployment serves each tool kind (tools of other kinds keep their configured backend).
DEPLOYMENT_OF_KIND = {"sandbox": "sandbox", "search": "emulators", "reward": "emulators"}


@serve.ingress()
class GatewayIngress:
    def __init__(
        self,
        settings: dict[str, Any],
        sandbox: DeploymentHandle,
        emulators: DeploymentHandle,
    ) -> None:
        self.settings = GatewaySettings(**settings)  # loaded by the driver, passed as values
        self.handles = {"sandbox": sandbox, "emulators": emulators}

    def __serve_build_asgi_app__(self) -> ASGIApp:
        backends = {
            tool.name: RayBackend(tool, self.handles[DEPLOYMENT_OF_KIND[tool.kind]])
            for tool in self.settings.tool_table()
            if tool.kind in DEPLOYMENT_OF_KIND
        }
        return create_app(self.settings, backends=backends)
