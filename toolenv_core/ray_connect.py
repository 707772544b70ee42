"""Connecting a driver to a Ray cluster: a one-line error in seconds where `ray.init` gives none.

With nothing listening at `HOST:PORT`, `ray.init` retries for about 14 minutes (20 attempts of
about 40 s each in Ray 2.60, a log line per attempt), and as long where something else
answers (the dashboard's port); an address it cannot parse, or `auto` with no cluster on this
machine, is a traceback. Every command that connects to a cluster checks
first: `toolenv serve --ray` through `init_ray`, `toolenv rollout study --ray` through
`check_reachable` before it loads its inputs. Imported only by the modules that use Ray (an
optional extra).
"""

from __future__ import annotations

import os
import socket
from typing import Any

import grpc
import ray
from ray._private.services import canonicalize_bootstrap_address
from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

from .ray_lean import CLUSTER_ENV

LOCAL = "local"  # Ray's name for "start a new local cluster"
CLIENT_SCHEME = "ray://"  # a Ray Client server, not the GCS
CONNECT_TIMEOUT_S = 5.0


class RayUnreachable(ConnectionError):
    """No Ray cluster answers at the address given; the message says which and why."""


def cluster_address(address: str) -> str:
    """HOST:PORT that `ray.init(address)` dials: `auto` is RAY_ADDRESS, else the last cluster
    `ray start` started on this machine; localhost names become this node's address."""
    if address.startswith(CLIENT_SCHEME):
        return host_port(address, address.removeprefix(CLIENT_SCHEME))
    if address != "auto":  # checked first: Ray logs a traceback for an empty host
        host_port(address, address)
    try:
        resolved = canonicalize_bootstrap_address(address)
    except (ValueError, ConnectionError) as exc:
        raise RayUnreachable(f"no Ray cluster at {address!r}: {exc}") from None
    if resolved is None:  # "local" or an empty RAY_ADDRESS: nothing to dial
        raise RayUnreachable(f"no Ray cluster at {address!r}")
    return host_port(address, resolved)


def host_port(address: str, target: str) -> str:
    """`target` if it is HOST:PORT with a host and a TCP port, else `RayUnreachable`."""
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RayUnreachable(f"no Ray cluster at {address!r}: not HOST:PORT")
    return target


# What a server that is not a GCS answers a GCS call with (an HTTP/1 server, an HTTP/2 one without
# the service, one that never answers); any other status (UNAUTHENTICATED, with token auth) is
# a GCS's own.
NOT_A_GCS = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Raise `RayUnreachable` unless a TCP connection to the cluster's address opens and, there,
    a GCS answers (`not_a_gcs`)."""
    target = cluster_address(address)
    host, _, port = target.rpartition(":")
    via = "" if target == address else f" (as {target})"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        raise RayUnreachable(f"no Ray cluster answers at {address}{via}: {why}") from None
    if not address.startswith(CLIENT_SCHEME) and (why := not_a_gcs(target, timeout_s)):
        raise RayUnreachable(f"no Ray cluster answers at {address}{via}: {why}")


def not_a_gcs(target: str, timeout_s: float) -> str | None:
    """Why what listens at HOST:PORT is no cluster's GCS, else None. Something else there (the
    dashboard's port 8265, which `ray job submit` takes; a Serve or toolenv port) took the TCP
    connection, and `ray.init` then retried for minutes with a log line every 5 s. Not checked
    with `RAY_USE_TLS` (Ray's channel then needs its certificates): left to `ray.init`."""
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        return None
    with grpc.insecure_channel(target) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]  # a grpc.Call as well
            if code in NOT_A_GCS:
                return f"something answers there, but not a Ray cluster's GCS ({code.name})"
    return None


def init_ray(address: str, **kwargs: Any) -> None:
    """`ray.init(address, **kwargs)`: `local` starts a new local cluster (never one found running
    here, `init_local`); any other address must answer first (`check_reachable`)."""
    if address == LOCAL:
        init_local(**kwargs)
        return
    check_reachable(address)
    ray.init(address=address, **kwargs)


def init_local(**kwargs: Any) -> None:
    """`ray.init` of a new local cluster without the dashboard and with `CLUSTER_ENV` (what the
    environment sets wins), as docs/ray.md says of the clusters toolenv starts: the study's had
    the dashboard's ten processes and Ray's metrics pipeline beside its cells."""
    for key, value in CLUSTER_ENV.items():
        os.environ.setdefault(key, value)
    ray.init(address=LOCAL, include_dashboard=False, **kwargs)
