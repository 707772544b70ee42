"""The Ray Serve application: the gateway ingress bound to the sandbox and emulator deployments.

`build_application` takes settings objects (the CLI loads them once); `build` is the
`serve run toolenv.ray:build [config=FILE]` entry point. Settings travel to the replicas as
values, so the nodes need no config file.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from emulators.settings import EmulatorSettings
from gateway.settings import GatewaySettings
from sandboxd.settings import SandboxSettings
from toolenv.ray_settings import RaySettings
from toolenv_core.config import read_sections

from .ingress import GatewayIngress
from .replicas import ServiceReplica


@dataclass(slots=True)
class RayStack:
    """Every setting the Ray application is built from."""

    ray: RaySettings
    gateway: GatewaySettings
    sandbox: SandboxSettings
    emulators: EmulatorSettings

    @classmethod
    def load(cls, config_file: str | None = None, address: str | None = None) -> RayStack:
        """Every section from one read of the config file (else `TOOLENV_CONFIG`)."""
        sections = read_sections(config_file)
        overrides = {"address": address} if address is not None else {}
        return cls(
            RaySettings.from_sections(sections, **overrides),
            GatewaySettings.from_sections(sections),
            SandboxSettings.from_sections(sections),
            EmulatorSettings.from_sections(sections),
        )


def build_application(stack: RayStack) -> Application:
    r = stack.ray
    # A sandbox replica runs as many programs as it takes calls: Ray's queue holds the rest
    # (which is what autoscaling counts).
    sandbox_values = {
        **stack.sandbox.model_dump(),
        "max_concurrency": r.sandbox.max_ongoing_requests,
        "queue_size": r.sandbox.max_ongoing_requests,  # calls still unwinding after a cancel
    }
    sandbox = serve.deployment(ServiceReplica, name="sandbox").options(
        **r.sandbox.deployment_options()
    )
    emulators = serve.deployment(ServiceReplica, name="emulators").options(
        **r.emulators.deployment_options()
    )
    gateway = serve.deployment(GatewayIngress, name="gateway").options(
        **r.gateway.deployment_options()
    )
    return gateway.bind(
        stack.gateway.model_dump(),
        sandbox.bind("sandbox", sandbox_values),
        emulators.bind("emulators", stack.emulators.model_dump()),
    )


def build(args: dict[str, str]) -> Application:
    """`serve run toolenv.ray:build [config=FILE]`: the application from a config file."""
    return build_application(RayStack.load(args.get("config")))


def deploy(stack: RayStack) -> DeploymentHandle:
    """Connect (or start a local cluster), start Serve's HTTP proxies, run the application."""
    r = stack.ray
    if not ray.is_initialized():
        ray.init(address=r.address, log_to_driver=False)
    serve.start(
        proxy_location=r.proxy_location,
        http_options={"host": r.http_host, "port": r.http_port},
    )
    return serve.run(build_application(stack), name=r.app_name, route_prefix="/")
