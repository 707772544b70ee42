"""A real two-node Ray cluster on this machine, and what the tests do with it.

Each node is its own network namespace (its own loopback, its own address on a veth), so the
two are two hosts to Ray and no Ray traffic leaves namespaces this fixture made. The cluster,
the Serve HTTP proxy and every client run inside the head's namespace. Teardown deletes the
application gracefully, stops every process in the namespaces by PID and deletes them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from toolenv.ray.netns import NetnsCluster

HERE = Path(__file__).parent
APP = "toolenv"
URL = "http://127.0.0.1:8000"  # the head namespace's own loopback

BASE_CONFIG: dict[str, Any] = {
    "ray": {
        "app_name": APP,
        "http_port": 8000,
        # the ingress stays on the head: the node that dies is a sandbox node
        "gateway": {"num_cpus": 0, "resources": {"node_head": 0.01}},
        "sandbox": {
            "num_cpus": 0.5, "max_ongoing_requests": 4, "min_replicas": 2, "max_replicas": 2,
        },
        "emulators": {
            "num_cpus": 0, "max_ongoing_requests": 256, "min_replicas": 2, "max_replicas": 2,
        },
    },
    "gateway": {
        "tools": [
            {"name": "sandbox", "kind": "sandbox", "concurrency": 64, "queue": 256},
            # the same deployment behind a tight admission bound: 429 + Retry-After
            {"name": "sandbox_tight", "kind": "sandbox", "concurrency": 1, "queue": 0},
            {
                "name": "search", "kind": "search", "concurrency": 64, "queue": 256,
                "retry": {"enabled": True, "max_attempts": 5, "min_retries_per_s": 100},
            },
        ],
    },
    "sandbox": {"warm_sandboxes": 2},
    "emulators": {"search_profile": {"tool": "search", "model": {"kind": "constant", "value_s": 0.2}}},
}  # fmt: skip


PREFIX = "toolenv-sandboxd-"


def leftovers(pids: set[int]) -> list[str]:
    """Run dirs, cgroups and processes that belong to sandbox replicas with these PIDs."""
    names = {f"{PREFIX}{p}" for p in pids}
    found = [str(d) for d in Path("/dev/shm").glob(f"{PREFIX}*") if d.name in names]
    for controller in Path("/sys/fs/cgroup").iterdir():
        for root, dirs, _ in os.walk(controller):
            if len(Path(root).relative_to(controller).parts) >= 4:
                dirs.clear()
            found += [os.path.join(root, d) for d in dirs if d in names]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(n in cmdline for n in names):
            found.append(f"pid {proc.name}: {cmdline[:200]}")
    return found


def sandbox_replica_pids(pids: list[int]) -> set[int]:
    """Which of these processes are sandbox replicas (their title names the deployment)."""
    found = set()
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"ServeReplica:" in cmdline and b":sandbox" in cmdline:
            found.add(pid)
    return found


@dataclass
class RayEnv:
    """The cluster plus what the tests do with it (every command runs in the head namespace)."""

    cluster: NetnsCluster
    workdir: Path
    dead_node_pids: set[int] = field(default_factory=set)  # the node the node-death test killed

    @property
    def trace(self) -> Path:
        """The gateway replica's trace capture (the nodes share this machine's disk)."""
        return self.workdir / "trace.jsonl"

    @property
    def head_ip(self) -> str:
        return self.cluster.nodes[0].ip

    @property
    def worker_ip(self) -> str:
        return self.cluster.nodes[1].ip

    def deploy(self, config: dict[str, Any], name: str) -> Path:
        """`toolenv serve --ray ADDRESS -c FILE --detach` (deploys, or updates in place)."""
        config = {**config, "gateway": {**config["gateway"], "trace_path": str(self.trace)}}
        path = self.workdir / f"{name}.yaml"
        done = self.serve_detached(config, name)
        assert done.returncode == 0, done.stderr[-3000:]
        return path

    def serve_detached(
        self, config: dict[str, Any], name: str, *options: str
    ) -> subprocess.CompletedProcess[str]:
        """`toolenv serve --ray ADDRESS -c FILE --detach [options]`, as it ended."""
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        argv = [sys.executable, "-m", "toolenv", "serve", "--ray", self.cluster.address]
        return self.run([*argv, "-c", str(path), "--detach", *options], timeout=240)

    def run(self, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.cluster.exec_argv(argv),
            env=self.cluster.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def helper_argv(self, *args: str, node: int = 0) -> list[str]:
        return self.cluster.exec_argv([sys.executable, str(HERE / "in_cluster.py"), *args], node)

    def helper(self, *args: str, timeout: float = 120, node: int = 0) -> Any:
        """`in_cluster.py ARGS` in a node's namespace (the head's by default)."""
        done = subprocess.run(
            self.helper_argv(*args, node=node),
            env=self.cluster.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    def load(self, *args: str, timeout: float = 180) -> list[dict[str, Any]]:
        return self.helper("load", URL, *args, timeout=timeout)

    def applications(self) -> dict[str, str]:
        """Every Serve application on the cluster and its status."""
        return self.helper("applications", self.cluster.address)

    def replicas(self) -> dict[str, Any]:
        return self.helper("replicas", self.cluster.address, APP)

    def wait_replicas(
        self, deployment: str, running: int, timeout_s: float, alive_nodes: int | None = None
    ) -> dict[str, Any]:
        end = time.monotonic() + timeout_s
        while True:
            status = self.replicas()
            ok = status[deployment].get("RUNNING", 0) == running and (
                alive_nodes is None or len(status["_alive_nodes"]) == alive_nodes
            )
            if ok or time.monotonic() > end:
                return status
            time.sleep(1)
