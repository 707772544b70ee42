"""One sandbox container: how it is created (every isolation flag in one place), readied, destroyed."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
from docker.types import Ulimit

from ..settings import SandboxSettings
from .agent_client import AgentConnection, AgentError

LABEL = "toolenv.sandbox"
POOL_LABEL = "toolenv.pool"
LOCK_LABEL = "toolenv.lock"
AGENT_DIR = "/run/toolenv"  # inside the container: the bind-mounted host directory (mode 0700)
WORKDIR = "/sandbox"
# What the agent needs for the reset, and nothing more: drop to the program uid (SETUID, SETGID),
# kill its processes (KILL), and wipe/restore files the program owns (CHOWN, DAC_OVERRIDE, FOWNER).
# The program never holds them: setuid to a non-root uid clears them; no-new-privileges stops
# setuid binaries and file capabilities from giving any back.
MAX_INODES = 16384
AGENT_CAPABILITIES = ["SETUID", "SETGID", "KILL", "CHOWN", "DAC_OVERRIDE", "FOWNER"]


class ContainerStartError(RuntimeError):
    """A container did not come up with a clean, answering agent."""


def container_config(
    settings: SandboxSettings, name: str, socket_dir: str, labels: dict[str, str]
) -> dict[str, Any]:
    """Keyword arguments of `containers.run` for one sandbox container."""
    uid = settings.docker_run_uid
    return {
        "image": settings.docker_image,
        "command": [
            "/usr/bin/python3",
            "-I",
            "-S",
            "/opt/toolenv/agent.py",
            f"{AGENT_DIR}/agent.sock",
            str(uid),
            str(uid),
        ],  # fmt: skip
        "name": name,
        "detach": True,
        "labels": labels,
        "hostname": "sandbox",
        "network_mode": "none",
        "read_only": True,
        "tmpfs": {
            # nr_inodes bounds what a reset may have to delete (a flood of empty files)
            WORKDIR: f"rw,exec,nosuid,nodev,size={settings.docker_workdir_mb}m,"
            f"nr_inodes={MAX_INODES},uid={uid},gid={uid},mode=0700",
            "/tmp": f"rw,noexec,nosuid,nodev,size={settings.docker_tmp_mb}m,"
            f"nr_inodes={MAX_INODES},mode=1777",
            # not `shm_size`: Docker's /dev/shm has no inode bound (a program made a million
            # empty files there, which the reset then had to delete)
            "/dev/shm": f"rw,noexec,nosuid,nodev,size={settings.docker_tmp_mb}m,"
            f"nr_inodes={MAX_INODES},mode=1777",
        },
        "ipc_mode": "private",
        # The container's network namespace outlives each run: a connection a run closed sat in
        # TIME_WAIT for 60 s, so the next run in the container could not bind that port
        # (EADDRINUSE) and saw it in /proc/net/tcp. Without buckets none is kept.
        "sysctls": {"net.ipv4.tcp_max_tw_buckets": "0"},
        "volumes": {socket_dir: {"bind": AGENT_DIR, "mode": "rw"}},
        "mem_limit": f"{settings.docker_memory_mb}m",
        "memswap_limit": f"{settings.docker_memory_mb}m",
        "nano_cpus": int(settings.docker_cpus * 1e9),
        "cpu_shares": settings.run_cpu_shares,  # one run per container: the run's CPU weight
        "pids_limit": settings.docker_pids_limit,
        "ulimits": [Ulimit(name="nofile", soft=4096, hard=4096)],
        "cap_drop": ["ALL"],
        "cap_add": AGENT_CAPABILITIES,
        "security_opt": ["no-new-privileges"],
        "environment": {},
        "working_dir": WORKDIR,
    }


@dataclass
class SandboxContainer:
    """A running container whose agent answered `hello` from a verified clean state."""

    name: str
    id: str
    socket_dir: Path
    conn: AgentConnection
    runs: int = 0
    created: float = field(default_factory=time.monotonic)

    @property
    def socket_path(self) -> str:
        return str(self.socket_dir / "agent.sock")


async def create_container(
    client: docker.DockerClient,
    settings: SandboxSettings,
    name: str,
    socket_dir: Path,
    labels: dict[str, str],
    timeout_s: float,
) -> SandboxContainer:
    """Start a container and wait for its agent; on any failure nothing is left behind."""
    socket_dir.mkdir(mode=0o700)
    os.chmod(socket_dir, 0o700)  # despite the umask: the program's uid must not enter it
    config = container_config(settings, name, str(socket_dir), labels)
    container_id: str | None = None
    try:
        container = await asyncio.to_thread(client.containers.run, **config)
        container_id = container.id
        conn = await asyncio.wait_for(
            _connect(client, container_id, str(socket_dir / "agent.sock")), timeout_s
        )
        return SandboxContainer(name=name, id=container_id, socket_dir=socket_dir, conn=conn)
    except BaseException as exc:
        await asyncio.shield(remove_container(client, container_id or name, socket_dir))
        if isinstance(exc, asyncio.CancelledError):
            raise
        raise ContainerStartError(f"container {name} did not start: {exc!r}") from exc


async def _connect(
    client: docker.DockerClient, container_id: str, socket_path: str
) -> AgentConnection:
    pause = 0.01
    while True:
        if os.path.exists(socket_path):
            try:
                conn = await AgentConnection.open(socket_path)
            except OSError:
                conn = None  # bound but not listening yet
            if conn is not None:
                hello = await conn.request({"op": "hello"})
                initial = hello.get("initial", {})
                if not hello.get("ok") or not initial.get("clean"):
                    conn.close()
                    raise AgentError(f"agent not ready or not clean: {hello}")
                return conn
        await asyncio.sleep(pause)
        pause = min(pause * 1.5, 0.2)
        if pause >= 0.2:  # slow start: make sure the container has not died meanwhile
            state = await asyncio.to_thread(_state, client, container_id)
            if state != "running":
                logs = await asyncio.to_thread(_logs, client, container_id)
                raise AgentError(f"container is {state}: {logs}")


def _state(client: docker.DockerClient, container_id: str) -> str:
    try:
        return client.containers.get(container_id).status
    except docker.errors.NotFound:
        return "gone"


def _logs(client: docker.DockerClient, container_id: str) -> str:
    try:
        return client.containers.get(container_id).logs(tail=20).decode(errors="replace")
    except docker.errors.DockerException:
        return ""


async def remove_container(
    client: docker.DockerClient, container_id: str, socket_dir: Path | None = None
) -> None:
    """Kill and remove a container (SIGKILL; no grace) and its socket directory."""
    await asyncio.to_thread(remove_container_sync, client, container_id)
    if socket_dir is not None:
        shutil.rmtree(socket_dir, ignore_errors=True)


def remove_container_sync(client: docker.DockerClient, container_id: str) -> None:
    try:
        client.api.remove_container(container_id, force=True, v=True)
    except docker.errors.NotFound:
        pass
    except docker.errors.APIError as exc:
        if "already in progress" not in str(exc):
            raise
