"""Resetting the sandbox container between jobs: kill and reap every other process, empty the
writable places, remove System V IPC objects, read the OOM-kill counter.

Standard library only, like agent.py, next to which it is copied into the sandbox image.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

SYSVIPC = ("/proc/sysvipc/shm", "/proc/sysvipc/sem", "/proc/sysvipc/msg")
# the container's own memory cgroup: cgroup v1 (memory.oom_control) or v2 (memory.events)
OOM_COUNTERS = ("/sys/fs/cgroup/memory/memory.oom_control", "/sys/fs/cgroup/memory.events")
KILL_TIMEOUT_S = 5.0


def other_pids() -> list[int]:
    """Every process of this PID namespace except the agent (PID 1)."""
    me = os.getpid()
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_everything() -> bool:
    """SIGKILL every process but the agent, reap them, repeat until none is left (or give up)."""
    deadline = time.monotonic() + KILL_TIMEOUT_S
    pause = 0.0005
    while True:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reap()
        if not other_pids():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def oom_kills() -> int:
    for path in OOM_COUNTERS:
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except OSError:
            continue
    return 0


def sysv_ids() -> dict[str, list[int]]:
    """Live System V IPC objects (shm, sem, msg) by kind."""
    found: dict[str, list[int]] = {}
    for path in SYSVIPC:
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        ids = [int(line.split()[1]) for line in lines if line.strip()]
        if ids:
            found[path.rsplit("/", 1)[1]] = ids
    return found


def remove_sysv(uid: int, gid: int, ids: dict[str, list[int]]) -> None:
    """Remove IPC objects as their owner (root here lacks CAP_SYS_ADMIN, on purpose)."""
    pid = os.fork()
    if pid == 0:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            for i in ids.get("shm", []):
                libc.shmctl(i, 0, None)  # IPC_RMID
            for i in ids.get("sem", []):
                libc.semctl(i, 0, 0)
            for i in ids.get("msg", []):
                libc.msgctl(i, 0, None)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def empty_dir(path: str) -> None:
    for entry in os.scandir(path):
        full = os.path.join(path, entry.name)
        try:
            if entry.is_dir(follow_symlinks=False):
                remove_tree(full)
            else:
                os.unlink(full)
        except FileNotFoundError:
            pass


def remove_tree(path: str) -> None:
    """`shutil.rmtree` at any depth: it recurses once per level, so a program's `mkdir d; cd d`
    loop 3000 deep raised RecursionError out of the reset and the agent (PID 1) died with it,
    taking its container. `rm -rf` (no recursion limit) removes what rmtree could not."""
    try:
        shutil.rmtree(path)
    except RecursionError:
        subprocess.run(
            ["rm", "-rf", "--one-file-system", "--", path],
            check=False,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
