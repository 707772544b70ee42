"""Where the CPU of a Ray set-up goes: every process of the nodes' namespaces, read from /proc,
summed by group (the local gateway, the Ray gateway and replicas, Ray's own processes) and the
threads of the gateways and replicas by kind. `ray_bench` reads both around each run."""

from __future__ import annotations

import os
from pathlib import Path

from toolenv.ray.netns import NetnsCluster

_TICK = os.sysconf("SC_CLK_TCK")
# Processes of the nodes' namespaces by what they are. The load generator is left out, and so
# are the sandboxed programs (their own namespaces): the same work on both paths.
_GROUPS = (
    ("toolenv serve --port", "local_gateway"),
    ("ray::ServeReplica:toolenv:gateway", "ray_gateway"),
    ("ray::ServeReplica:toolenv:sandbox", "ray_sandbox"),
    ("ray::ServeReplica:toolenv:emulators", "ray_emulators"),
    ("benchmarks.ray_bench load", None),
)


# Ray's own processes, by what they are (the first marker found in the command line).
_SYSTEM = (
    ("gcs_server", "gcs_server"),
    ("raylet/raylet", "raylet"),
    ("ServeController", "serve_controller"),
    ("DashboardAgent", "dashboard_agent"),
    ("RuntimeEnvAgent", "runtime_env_agent"),
    ("dashboard/dashboard.py", "dashboard"),
    ("log_monitor.py", "log_monitor"),
    ("autoscaler/_private/monitor.py", "autoscaler_monitor"),
    ("ray.util.client.server", "client_server"),
)


def _system_kind(cmdline: str) -> str:
    """`ray_system:<kind>` for one of Ray's own processes (`other`: idle workers and the rest)."""
    for marker, kind in _SYSTEM:
        if marker in cmdline:
            return f"ray_system:{kind}"
    return "ray_system:other"


def cpu_by_group(cluster: NetnsCluster) -> dict[str, float]:
    """CPU seconds (user + system) so far of every process in the nodes' namespaces, summed by
    group; Ray's own processes (GCS, raylets, Serve controller, agents) are `ray_system:<kind>`."""
    out: dict[str, float] = {}
    for node in range(len(cluster.nodes)):
        for pid in cluster.pids(node):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            group: str | None = _system_kind(cmdline)
            for marker, name in _GROUPS:
                if marker in cmdline:
                    group = name
                    break
            if group is not None:
                out[group] = out.get(group, 0.0) + (int(fields[11]) + int(fields[12])) / _TICK
    return out


# Threads of the gateways and replicas by what they are (their `comm`, trailing digits dropped).
# A Ray worker's Python threads keep the name the process had when they started: `ray::IDLE`
# is the replica's event loop (its code, Serve's, gRPC's Python side) and gRPC's poller thread.
_THREAD_KINDS = {"ray::IDLE": "python", "ray::ServeRepli": "ray_main", "event_engine": "grpc_io"}


def threads_by_group(cluster: NetnsCluster) -> dict[tuple[str, str], tuple[float, int]]:
    """(CPU seconds, context switches) so far of the threads of the gateways and replicas
    (not Ray's own processes), summed by (group, thread kind)."""
    out: dict[tuple[str, str], tuple[float, int]] = {}
    for node in range(len(cluster.nodes)):
        for pid in cluster.pids(node):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            group = next((name for marker, name in _GROUPS if marker in cmdline), None)
            if group is None:
                continue
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    status = task.joinpath("status").read_text()
                    fields = task.joinpath("stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                info = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
                name = info["Name"].rstrip("0123456789")
                key = (group, "main" if task.name == str(pid) and group.startswith("local")
                       else _THREAD_KINDS.get(name, name))  # fmt: skip
                cpu = (int(fields[11]) + int(fields[12])) / _TICK
                switches = int(info["voluntary_ctxt_switches"]) + int(
                    info["nonvoluntary_ctxt_switches"]
                )
                was = out.get(key, (0.0, 0))
                out[key] = (was[0] + cpu, was[1] + switches)
    return out
