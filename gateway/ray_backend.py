"""A tool served by a Ray Serve deployment, called through the deployment handle it is given.

Ray's router picks the replica (it balances on each replica's queue), so this backend has one
endpoint, the deployment. The replica answers `call(method, path, body, headers)` with the raw
ASGI reply of the service it hosts. Cancelling the caller (a deadline, a lost hedge) cancels the
Ray request, which cancels the handler inside the replica: the sandbox kills its program there.
A replica that dies mid-call is a broken upstream (502; retried for idempotent tools).

Only the Ray wiring (`toolenv.ray`) imports this module: the gateway itself runs without Ray.
"""

from __future__ import annotations

import asyncio

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    RayServeException,
    ReplicaUnavailableError,
)
from ray.serve.handle import DeploymentHandle

from .settings import ToolConfig
from .upstream import Endpoint, UpstreamBroken, UpstreamConnectError, UpstreamReply, asgi_reply


class RayBackend:
    """Calls go to `handle.call.remote(...)`; Ray picks the replica."""

    def __init__(self, tool: ToolConfig, handle: DeploymentHandle, max_replicas: int = 1) -> None:
        self.tool = tool
        self.max_replicas = max_replicas
        # Serve's gRPC data path (`_by_reference=False`, what `RAY_SERVE_THROUGHPUT_OPTIMIZED`
        # turns on): one gRPC call straight to the replica instead of a Ray actor task with a
        # streaming reply, the same router and queue-length rejection. Our arguments and reply
        # are plain str/bytes/dict/tuple values: plain pickle, not cloudpickle.
        self.handle = handle.options(
            method_name="call",
            _by_reference=False,
            request_serialization="pickle",
            response_serialization="pickle",
        )
        self.endpoints = [Endpoint(label=f"ray:{handle.deployment_name}")]

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def not_ready(self) -> str | None:
        return None  # Ray Serve keeps the replicas; a call waits for one (under its deadline)

    def one_replica_of_many(self) -> str | None:
        """A call reaches the one replica Ray's router picks, and Serve has no call to every
        replica: with more than one (or autoscaling) a change would reach one and leave the
        others, and every replica started later, as they were."""
        if self.max_replicas == 1:
            return None
        return (
            f"it runs on up to {self.max_replicas} replicas of Ray Serve deployment "
            f"{self.handle.deployment_name!r}, and a change would reach only one of them"
        )

    async def send(
        self, endpoint: Endpoint, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> UpstreamReply:
        response = self.handle.remote(method, path, body, headers)
        try:
            status, out, payload = await response
        except asyncio.CancelledError:
            response.cancel()  # the replica's handler is cancelled: it kills what it started
            raise
        except (BackPressureError, DeploymentUnavailableError) as exc:
            # The request never reached a replica: safe to retry, 503 when not retried.
            raise UpstreamConnectError(f"{endpoint.label}: {type(exc).__name__}") from exc
        except (RayActorError, ReplicaUnavailableError) as exc:
            raise UpstreamBroken(f"{endpoint.label}: the replica died mid-call") from exc
        except (RayTaskError, RayServeException) as exc:
            raise UpstreamBroken(f"{endpoint.label}: {type(exc).__name__}") from exc
        return asgi_reply(status, out, payload, endpoint.label)
