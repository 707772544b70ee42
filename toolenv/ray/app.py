"""The Ray Serve application: the gateway deployment bound to the sandbox and emulator ones.

`build_application` takes settings objects (the CLI loads them once); `build` is the
`serve run toolenv.ray:build [config=FILE]` entry point. Settings travel to the replicas as
values, so the nodes need no config file.

The gateway replicas serve HTTP themselves (`ingress.GatewayServer`), so the application has
no Serve route and Serve runs no HTTP proxy. Every replica runs its code on the replica's own
event loop, and a handle's router on its caller's loop (`REPLICA_ENV`, Serve's documented
switches): otherwise each call crosses two threads on each side of a handle call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve
from ray.serve import Application, RunTarget
from ray.serve.schema import ApplicationStatus, DeploymentStatus

from emulators.settings import EmulatorSettings
from gateway.settings import GatewaySettings
from sandboxd.settings import SandboxSettings
from toolenv.ray_settings import RaySettings, ReplicaConfig
from toolenv.sections import read_all_sections, with_sandbox_defaults
from toolenv_core.ray_connect import LOCAL, init_ray

from .ingress import GatewayServer
from .lean import GRPC_ENV
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
        """Every section from one read of the config file (else `TOOLENV_CONFIG`). `address`
        (the `--ray` option) wins over the file's and the environment's `ray.address`, `local`
        too: it was dropped as "no override", and the file's cluster was dialled instead."""
        sections = read_all_sections(config_file)
        overrides: dict[str, str | None] = {}
        if address is not None:
            overrides["address"] = None if address == LOCAL else address
        return cls(
            RaySettings.from_sections(sections, **overrides),
            with_sandbox_defaults(GatewaySettings.from_sections(sections), sections),
            SandboxSettings.from_sections(sections),
            EmulatorSettings.from_sections(sections),
        )


# Set in every replica's process (runtime_env): user code and handle routers on the replica's
# main event loop, no thread hop per call. A replica's code must then not block its loop; ours
# is asyncio throughout.
# Serve's cached request metrics go to Ray's metrics API once a second instead of ten times: a
# replica's and a router's timers, not per-call work (Serve counts every call either way).
# gRPC's socket I/O on its poller thread instead of extra threads (`lean.GRPC_ENV`).
# A handle call's request and reply up to gRPC's largest message (2 GiB - 1, the size Serve's
# other gRPC servers take), not its 4 MiB default: that one bound is read both by the replica's
# server (the request) and by the handle's channel (the reply), and it refused what the gateway
# (`max_body_bytes`, 16 MiB) and sandboxd (`max_output_bytes`) accept, as a 502. Those two are
# the bounds; this one must not be lower.
REPLICA_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1),
    **GRPC_ENV,
}
# Serve's per-request access log is a log record per call in every replica it crosses; with the
# access log off Serve still builds that record and drops it, unless INFO is below the level.
LOGGING = {"enable_access_log": False, "log_level": "WARNING"}


# Past the gateway's shutdown grace: its replica waits that long for calls in flight (then up to
# 5 s more for uvicorn to stop, `GatewayServer.__del__`), and a sandbox replica drains once the
# gateway has cancelled what was left, then releases its pool.
SHUTDOWN_MARGIN_S = 10.0


def replica_options(config: ReplicaConfig, shutdown_s: float) -> dict[str, Any]:
    """A deployment's Serve options: its replica config, our replica env and logging, and how
    long Serve lets a stopping replica finish (`shutdown_s`) before it kills it. At Serve's
    default (20 s) it killed the replicas within the gateway's own grace (30 s), and a sandbox
    replica with a program running left its run dir and cgroups behind."""
    options = config.deployment_options()
    options["ray_actor_options"]["runtime_env"] = {"env_vars": dict(REPLICA_ENV)}
    options["logging_config"] = dict(LOGGING)
    options["graceful_shutdown_timeout_s"] = shutdown_s
    return options


def build_application(stack: RayStack) -> Application:
    """The application; a `ValueError` when the gateway replicas would listen on a non-loopback
    `http_host` with no API keys, as `toolenv serve --host` refuses (it served an open sandbox
    on every node's address)."""
    r = stack.ray
    stack.gateway.model_copy(update={"host": r.http_host}).check_bind()
    # A sandbox replica runs as many programs as it takes calls: Ray's queue holds the rest
    # (which is what autoscaling counts).
    sandbox_values = {
        **stack.sandbox.model_dump(),
        "max_concurrency": r.sandbox.max_ongoing_requests,
        "queue_size": r.sandbox.max_ongoing_requests,  # calls still unwinding after a cancel
    }
    shutdown_s = stack.gateway.shutdown_grace_s + SHUTDOWN_MARGIN_S
    sandbox = serve.deployment(ServiceReplica, name="sandbox").options(
        **replica_options(r.sandbox, shutdown_s)
    )
    emulators = serve.deployment(ServiceReplica, name="emulators").options(
        **replica_options(r.emulators, shutdown_s)
    )
    gateway = serve.deployment(GatewayServer, name="gateway").options(
        **replica_options(r.gateway, shutdown_s)
    )
    return gateway.bind(
        stack.gateway.model_dump(),
        r.http_host,
        r.http_port,
        sandbox.bind("sandbox", sandbox_values),
        emulators.bind("emulators", stack.emulators.model_dump()),
        {"sandbox": r.sandbox.max_replicas, "emulators": r.emulators.max_replicas},
    )


def build(args: dict[str, str]) -> Application:
    """`serve run toolenv.ray:build [config=FILE]`: the application from a config file."""
    return build_application(RayStack.load(args.get("config")))


def connect(stack: RayStack) -> None:
    """Connect to the stack's cluster (RayUnreachable when nothing answers), or start a new
    local one, never one found running on this machine."""
    if ray.is_initialized():
        return
    if stack.ray.address is None:
        init_ray(LOCAL, log_to_driver=False)  # without the background work toolenv does not use
    else:
        init_ray(stack.ray.address, log_to_driver=False)


def deploy(stack: RayStack, app: Application, timeout_s: float) -> bool:
    """Connect (`connect`), start Serve without its HTTP proxies (the gateway replicas serve
    HTTP), run the application (built from `stack` before connecting: Ray checks the
    deployments' options as it builds them) and wait at most `timeout_s` for it to run.
    `serve.run` waits without end: replicas no node can take (`num_cpus` above every node's)
    kept the command at "deploying" for ever, with no word of why.

    Returns whether the application is new on the cluster (none of its name ran before): what
    a failed start may delete (`remove_failed`). `DeployFailed` carries the same."""
    r = stack.ray
    connect(stack)
    if r.address is None and (why := no_node_takes(r)) is not None:
        # a local cluster is this command's own: no node will ever join it
        raise DeployFailed(f"no node of the local cluster can take {why}", created=False)
    serve.start(proxy_location="Disabled")
    created = app_status(r.app_name) is None
    # `run_many` (Serve's developer API) can leave the wait to us; `serve.run` cannot
    target = RunTarget(target=app, name=r.app_name, route_prefix=None)
    serve.run_many([target], wait_for_applications_running=False)
    end = time.monotonic() + timeout_s
    while (status := app_status(r.app_name)) != ApplicationStatus.RUNNING:
        if status == ApplicationStatus.DEPLOY_FAILED:  # Serve names the deployments only
            why = why_failed(r.app_name) or "`ray.serve.status()` on the cluster says more"
            raise DeployFailed(f"deploying application {r.app_name} failed: {why}", created)
        if time.monotonic() >= end:
            unplaced = no_node_takes(r)  # Serve says so itself only after 30 s
            raise DeployFailed(
                f"application {r.app_name} not running after {timeout_s:.0f} s: "
                f"{why_waiting(r.app_name)}"
                + (f" (no node can take {unplaced})" if unplaced else ""),
                created,
            )
        time.sleep(0.2)
    return created


def no_node_takes(r: RaySettings) -> str | None:
    """The deployments whose replica no live node can take (more `num_cpus` or `resources` than
    any offers), with what a replica needs and what each node has; None when every one fits.
    Serve waits for such a node (an autoscaler may add one) and names the resources only after
    30 s: `--ray local` waited out `--ready-timeout` (300 s) for a node that never joins."""
    nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
    said = []
    for name, config in (
        ("gateway", r.gateway),
        ("sandbox", r.sandbox),
        ("emulators", r.emulators),
    ):
        need = {"CPU": float(config.num_cpus), **{k: float(v) for k, v in config.resources.items()}}
        if not any(all(node.get(k, 0.0) >= v for k, v in need.items()) for node in nodes):
            offers = [{k: node.get(k, 0.0) for k in need} for node in nodes]
            said.append(f"{name} (a replica needs {need}; the nodes have {offers})")
    return "; ".join(said) or None


def remove_failed(app_name: str, created: bool) -> str:
    """Delete an application whose start failed if this start created it (its replicas held
    the cluster's resources after the command had exited 1); one deployed before is left as
    Serve has it, since its replicas of the old version may still serve. Says which."""
    if not created:
        return f"application {app_name} was deployed before: left as it is (`ray.serve.status()` on the cluster)"
    serve.delete(app_name)
    return f"application {app_name} deleted"


def app_status(app_name: str) -> ApplicationStatus | None:
    app = serve.status().applications.get(app_name)
    return app.status if app is not None else None


class DeployFailed(RuntimeError):
    """Serve gave up on the application, or it did not run in time; the message says which
    deployment and what its replicas raised (a port in use, a sandbox backend that cannot
    start) or wait for. `created`: the start that failed created the application."""

    def __init__(self, message: str, created: bool) -> None:
        super().__init__(message)
        self.created = created


def why_waiting(app_name: str) -> str:
    """Each deployment not yet running and what Serve says of it (for replicas that no node can
    take: the resources each needs and those the cluster has)."""
    app = serve.status().applications.get(app_name)
    deployments = app.deployments.items() if app is not None else []
    return (
        "; ".join(
            f"{name}: {' '.join(d.message.split()) or d.status}"
            for name, d in deployments
            if d.status != DeploymentStatus.HEALTHY
        )
        or "no deployment reported yet"
    )


def why_failed(app_name: str) -> str:
    """Each failed deployment's name and the last line of its replicas' error (Serve keeps the
    whole traceback in the deployment's status message)."""
    app = serve.status().applications.get(app_name)
    deployments = app.deployments.items() if app is not None else []
    return "; ".join(
        f"{name}: {d.message.strip().splitlines()[-1]}"
        for name, d in deployments
        if d.status == DeploymentStatus.DEPLOY_FAILED and d.message.strip()
    )
