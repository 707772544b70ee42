"""The gateway on Ray: a Serve deployment whose replicas serve the gateway's HTTP themselves.

Each replica runs the same app and the same uvicorn server as `toolenv serve` (the lane serves
the hot routes on the connection), with the sandbox and emulator tools bound to deployment
handles. Why not a Serve ingress behind Serve's HTTP proxy: that path put a proxy actor and an
ASGI-over-Ray hop in front of every call (about 8 ms of CPU per call, measured in docs/ray.md),
for nothing the gateway does not already do (admission, deadlines, request ids, metrics). Serve
still places, health-checks and restarts the replicas; the data path is HTTP in, one handle
call out.

The listening socket has SO_REUSEPORT: a replacement replica (redeploy, restart) binds beside
the one it replaces, and several replicas on one node share the port (the kernel spreads the
connections).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import ray
import uvicorn
from ray.serve.handle import DeploymentHandle

from gateway.app import create_app
from gateway.cli import uvicorn_config
from gateway.logs import setup_logging
from gateway.ray_backend import RayBackend
from gateway.settings import GatewaySettings

# Which deployment serves each tool kind (tools of other kinds keep their configured backend).
DEPLOYMENT_OF_KIND = {"sandbox": "sandbox", "search": "emulators", "reward": "emulators"}


def gateway_url(host: str, port: int) -> str:
    """The gateway replicas' URL on their node; an IPv6 host in brackets (`http://::1:8000` was
    an `InvalidURL` traceback once the application had deployed)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def readyz_problem(url: str) -> str | None:
    """None when `url`/readyz answers 200, else what it said (or why nothing answered)."""
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            resp = await client.get(f"{url}/readyz")
    except httpx.HTTPError as exc:
        return str(exc) or type(exc).__name__
    return None if resp.status_code == 200 else f"{resp.status_code} {resp.text[:300]}"


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port that other replicas on the node may bind too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class GatewayServer:
    """One gateway replica: the gateway app on its own uvicorn server, tools on handles."""

    async def __init__(
        self,
        settings: dict[str, Any],
        host: str,
        port: int,
        sandbox: DeploymentHandle,
        emulators: DeploymentHandle,
        max_replicas: dict[str, int] | None = None,
    ) -> None:
        """`max_replicas`: each deployment's, by name (1 when not given)."""
        self.settings = GatewaySettings(**settings)  # loaded by the driver, passed as values
        setup_logging(self.settings.log_level)
        handles = {"sandbox": sandbox, "emulators": emulators}
        most = max_replicas or {}
        backends = {
            tool.name: RayBackend(tool, handles[name], most.get(name, 1))
            for tool in self.settings.tool_table()
            if (name := DEPLOYMENT_OF_KIND.get(tool.kind)) is not None
        }
        app = create_app(self.settings, backends=backends)
        self.url = gateway_url(host, port)
        self.server = uvicorn.Server(uvicorn_config(app, self.settings, host, port))
        sock = listen_socket(host, port)  # a port in use fails the replica: Serve retries it
        self.task = asyncio.create_task(self._serve(sock), name="gateway-http")
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises why it stopped
                raise RuntimeError("the gateway's HTTP server stopped while starting")
            await asyncio.sleep(0.02)

    async def _serve(self, sock: socket.socket) -> None:
        try:
            await self.server.serve(sockets=[sock])
        except SystemExit as exc:  # uvicorn exits when a lifespan fails: never out of a task
            raise RuntimeError(f"the gateway failed to start (exit {exc.code})") from None
        finally:
            sock.close()

    async def check_health(self) -> None:
        """Serve's health check: a replica whose server has stopped is replaced."""
        if self.task.done():
            raise RuntimeError("the gateway's HTTP server has stopped")

    async def readiness(self) -> tuple[str, str | None]:
        """This replica's node address and what its `/readyz` says there (None: ready). Read on
        the replica's node, not by the command that deployed it: Ray places the replica on any
        node, and from another node its URL (`127.0.0.1` by default) answered nothing until
        `--ready-timeout`, when the command deleted an application that served."""
        return ray.util.get_node_ip_address(), await readyz_problem(self.url)

    async def __del__(self) -> None:
        """Graceful shutdown (scale-down, redeploy): stop accepting, finish the calls in flight
        (within the gateway's shutdown grace), then stop the tools."""
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), self.settings.shutdown_grace_s + 5)
        except (TimeoutError, RuntimeError):
            self.server.force_exit = True
