"""A multi-host Ray cluster on one Linux machine: one network namespace per node, joined by veth.

Why: Ray binds ports on every interface, so two `ray start` processes on one host's namespace
are not two hosts. Each node here gets its own namespace (its own loopback and ports), its own
address on a private /24 and its own custom resource (`<name>`: 1) so placement can be checked.
Everything that talks to the cluster runs inside the head's namespace (`exec_argv`). Nodes are
stopped by the PIDs in their namespace, never by name (`ray stop` would kill every Ray on the
machine). Needs root and `ip` (iproute2). Used by the tests and the benchmark, to rehearse a node
dying among others.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .lean import CLUSTER_ENV, HEAD_START_ARGS, RAY_START_ARGS

RAY_PORT = 6390  # away from Ray's default worker ports (10002-19999)
# Token auth off, whatever ~/.ray holds: Ray 2.60 turns it on for `ray start` as soon as a token
# file exists (a local `ray.init()` writes one), and drivers would then fail to connect. Ray's
# background work that toolenv does not use is off (`lean`).
_ENV = {
    **CLUSTER_ENV,
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
    "RAY_AUTH_MODE": "disabled",
}
# Fast failure detection: a dead node is declared dead in about 2 s instead of about 15 s.
SYSTEM_CONFIG = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}


class ClusterError(RuntimeError):
    """The cluster could not be set up (not root, no iproute2, ray start failed)."""


@dataclass(slots=True)
class Node:
    """One "host": a namespace, its address, and the custom resource that names it."""

    namespace: str
    ip: str
    resource: str
    temp_dir: Path
    num_cpus: int


@dataclass(slots=True)
class NetnsCluster:
    """Head plus `workers` nodes, each in its own network namespace on a private /24."""

    tag: str = field(default_factory=lambda: f"te{os.getpid() % 100000}")
    workers: int = 1
    num_cpus: int = 2
    subnet: int = field(default_factory=lambda: 100 + os.getpid() % 150)
    ray_bin: str = field(default_factory=lambda: str(Path(sys.executable).with_name("ray")))
    nodes: list[Node] = field(default_factory=list)
    _bridge: str | None = None

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{RAY_PORT}"

    def exec_argv(self, argv: list[str], node: int = 0) -> list[str]:
        """`argv` run inside a node's namespace (the head's by default)."""
        return ["ip", "netns", "exec", self.nodes[node].namespace, *argv]

    def env(self) -> dict[str, str]:
        return {**os.environ, **_ENV}

    # ------------------------------------------------------------------ lifecycle

    def start(self, ray: bool = True) -> NetnsCluster:
        """The namespaces, then `ray start` on each node (`ray=False`: the namespaces only, for
        a process that starts a cluster of its own inside the head's)."""
        if os.geteuid() != 0:
            raise ClusterError("a namespaced Ray cluster needs root (network namespaces)")
        if shutil.which("ip") is None:
            raise ClusterError("`ip` (iproute2) is not installed")
        names = ["head", *(f"w{i}" for i in range(1, self.workers + 1))]
        try:
            self._network(names)
            for node in self.nodes if ray else ():
                self._ray_start(node)
        except BaseException:
            self.stop()
            raise
        return self

    def _network(self, names: list[str]) -> None:
        bridge_ns = None
        if len(names) > 1:
            # A bridge in its own namespace joins every node's veth: any number of hosts.
            bridge_ns = f"{self.tag}br"
            _ip("netns", "add", bridge_ns)
            self._bridge = bridge_ns
            _ip("-n", bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", bridge_ns, "link", "set", "br0", "up")
        for i, name in enumerate(names):
            ns = f"{self.tag}{name}"
            ip = f"10.77.{self.subnet}.{i + 1}"
            _ip("netns", "add", ns)
            self.nodes.append(Node(ns, ip, f"node_{name}", Path(f"/tmp/ray-{ns}"), self.num_cpus))
            _ip("-n", ns, "link", "set", "lo", "up")
            if bridge_ns is None:
                continue
            inner, outer = f"{ns}i"[-15:], f"{ns}o"[-15:]
            _ip(
                "link", "add", inner, "netns", ns, "type", "veth", "peer", outer, "netns", bridge_ns
            )
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", bridge_ns, "link", "set", outer, "master", "br0")
            _ip("-n", bridge_ns, "link", "set", outer, "up")
        if bridge_ns is None:  # one node: its address lives on its loopback
            _ip("-n", self.nodes[0].namespace, "addr", "add", f"{self.nodes[0].ip}/32", "dev", "lo")

    def _ray_start(self, node: Node) -> None:
        shutil.rmtree(node.temp_dir, ignore_errors=True)
        common = [
            "--node-ip-address", node.ip, "--num-cpus", str(node.num_cpus),
            "--resources", json.dumps({node.resource: 1}), *RAY_START_ARGS,
            "--temp-dir", str(node.temp_dir), "--object-store-memory", str(200 * 1024 * 1024),
            "--min-worker-port", "20000", "--max-worker-port", "20999",
        ]  # fmt: skip
        if node is self.head:
            argv = [
                self.ray_bin, "start", "--head", "--port", str(RAY_PORT),
                *HEAD_START_ARGS, "--system-config", json.dumps(SYSTEM_CONFIG),
                *common,
            ]  # fmt: skip
        else:
            argv = [self.ray_bin, "start", "--address", self.address, *common]
        done = subprocess.run(
            ["ip", "netns", "exec", node.namespace, *argv],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise ClusterError(f"ray start on {node.namespace} failed: {done.stderr[-2000:]}")

    def pids(self, node: int) -> list[int]:
        out = subprocess.run(
            ["ip", "netns", "pids", self.nodes[node].namespace], capture_output=True, text=True
        ).stdout
        return [int(p) for p in out.split()]

    def kill_raylet(self, node: int) -> int:
        """A node dies: SIGKILL its raylet (its workers notice and exit). Returns the PID."""
        for pid in self.pids(node):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().strip() == "raylet":
                    os.kill(pid, signal.SIGKILL)
                    return pid
        raise ClusterError(f"no raylet in {self.nodes[node].namespace}")

    def stop_node(self, node: int, grace_s: float = 5.0) -> None:
        """Every process in the node's namespace: SIGTERM, then SIGKILL after the grace."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.pids(node)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            end = time.monotonic() + grace_s
            while pids and time.monotonic() < end:
                pids = [p for p in pids if Path(f"/proc/{p}").exists()]
                time.sleep(0.05)
            if not pids:
                return

    def stop(self) -> None:
        for i in reversed(range(len(self.nodes))):
            self.stop_node(i)
        for node in self.nodes:
            _ip("netns", "del", node.namespace, check=False)
            shutil.rmtree(node.temp_dir, ignore_errors=True)
        if self._bridge is not None:
            _ip("netns", "del", self._bridge, check=False)
        self.nodes.clear()
        self._bridge = None

    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _ip(*args: str, check: bool = True) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)}: {done.stderr.strip()}")
