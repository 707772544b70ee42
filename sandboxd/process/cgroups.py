"""Per-run cgroups (v1): pids.max against fork bombs, memory limit and peak, CPU weight, quota
and time. This module makes and pools the slots; `cgroup_slot` is one run's.

Each run gets one `CgroupSlot`: a directory per controller, nested under the service's own
cgroup (so whatever bounds the service also bounds its programs). Slots are created once and
reused through a pool, because mkdir/rmdir of four cgroup directories per run would cost more
than the rest of the per-run bookkeeping. A slot goes back to the pool only when it is empty
(no task left), with its counters reset; one that cannot be emptied is killed again and removed.
At start-up, directories left by a crashed earlier instance (named with a pid that no longer
runs) are removed.

Instances can share the parent cgroup and even a pid: replicas of one compose service
(`--scale sandbox=2`) each run sandboxd as pid 7 in their own PID namespace over the same
delegated subtree. So each instance holds an flock on its own base directory for its lifetime:
a directory someone holds is never reaped nor taken, and a new instance whose pid-named
directory is held takes `toolenv-sandboxd-<pid>-<n>` (before, the replicas shared every run
cgroup, and one stopping removed the other's slots under its running programs).

Every run has its own CPU group with the same weight (cpu.shares): the scheduler shares the CPU
per run, not per process, so a program that forks eight busy workers gets one run's share and a
short program in flight beside it still gets its own. The runs' parent group weighs as many runs
as may be in flight, so together they keep the standing on the host that as many processes would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import time
from collections.abc import Callable
from pathlib import Path

from toolenv_core.flocks import lock_if_still_there

from .cgroup_slot import (
    CFS_PERIOD_US,
    KEPT_FILES,
    CgroupSlot,
    cpu_usage_file,
    read_control,
    write_control,
)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PREFIX = "toolenv-sandboxd-"
# cpuacct gives the CPU time of a program under bwrap's init, which wait4 never sees (see
# `CgroupSlot.cpu_time_s`). Mounted with cpu (`cpu,cpuacct`), its files are in the cpu dir and it
# gets no dir of its own: each dir is one more task migration per cold run.
CONTROLLERS = ("pids", "memory", "cpu", "cpuacct")
MAX_SHARES = 262144  # the kernel's bound on cpu.shares
MIN_CFS_QUOTA_US = 1000  # the kernel refuses a smaller cpu.cfs_quota_us (EINVAL)
MIN_CPU_LIMIT = MIN_CFS_QUOTA_US / CFS_PERIOD_US  # in cores: the smallest cpu_limit it can hold


def _own_cgroup_paths() -> dict[str, str]:
    """Controller -> this process's cgroup path (from /proc/self/cgroup, v1 lines only)."""
    paths: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(","):
            if c:
                paths[c] = path
    return paths


def set_cpu_weight(d: Path, shares: int) -> None:
    """cpu.shares (v1) of `d`, or the equivalent cpu.weight (v2, systemd's mapping)."""
    shares = max(2, min(shares, MAX_SHARES))
    if (d / "cpu.shares").exists():
        write_control(d / "cpu.shares", str(shares))
    else:
        write_control(d / "cpu.weight", str(1 + (shares - 2) * 9999 // (MAX_SHARES - 2)))


def _left_by_dead_instance(d: Path, pid: int) -> bool:
    """The instance that made `d` (named with its pid) is gone: no such process, or one that
    started after `d` was made and reuses the pid (a restarted container's PID namespace)."""
    if pid == os.getpid():
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = time.time() - float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return True
    started = boot + int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return started > d.stat().st_ctime + 0.5


def _lock(d: Path) -> int | None:
    """An fd holding an exclusive flock on directory `d`, or None if another instance holds it
    (or `d` is gone: a stale one that another instance removed)."""
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)  # not inherited by the programs it starts
    except FileNotFoundError:
        return None
    if lock_if_still_there(fd, d, wait=False):
        return fd
    os.close(fd)
    return None


def _gone_owner(d: Path) -> bool:
    """`d` was made by an instance that is gone, going by its pid: dead, or ours (ours before
    this instance made its own: a sibling in another PID namespace that died)."""
    pid = d.name.removeprefix(PREFIX).split("-", 1)[0]
    if not pid.isdigit():
        return False
    return int(pid) == os.getpid() or _left_by_dead_instance(d, int(pid))


def claim_instance_dir(parent: Path, mode: int = 0o777) -> tuple[Path, int]:
    """This instance's dir under `parent`, named with its pid (`-<n>` after it when a live
    instance holds that name), and the fd of the flock that marks it this instance's for its
    lifetime (`reap_dead_instances` never takes a dir someone holds)."""
    for n in range(1000):
        d = parent / (f"{PREFIX}{os.getpid()}" + (f"-{n}" if n else ""))
        for _ in range(2):  # again if another instance reaped it between mkdir and lock
            d.mkdir(mode=mode, exist_ok=True)
            if (fd := _lock(d)) is not None:
                return d, fd
    raise OSError(f"every {PREFIX}{os.getpid()}-<n> is held by another instance")


def reap_dead_instances(parent: Path, remove: Callable[[Path], None]) -> None:
    """`remove` each dir under `parent` left by an instance that is gone and that no live
    instance holds, with its lock held (an instance starting now does not take it meanwhile)."""
    with contextlib.suppress(OSError):
        for d in parent.glob(f"{PREFIX}*"):
            if _gone_owner(d) and (fd := _lock(d)) is not None:
                try:
                    remove(d)
                finally:
                    os.close(fd)


class CgroupPool:
    """Pre-created per-run cgroups under `<own cgroup>/toolenv-sandboxd-<pid>/`."""

    def __init__(self, size: int, cpu_shares: int = 1024, in_flight: int = 1) -> None:
        self.size = size
        self.cpu_shares = cpu_shares  # each run's weight
        self.group_cpu_shares = min(cpu_shares * in_flight, MAX_SHARES)  # all runs together
        self.bases: dict[str, Path] = {}
        self._free: list[CgroupSlot] = []
        self._counter = 0
        self._draining: set[asyncio.Task[None]] = set()
        self._locks: list[int] = []  # flocks on the bases: they are this instance's
        self.unavailable_reason: str | None = None
        # the pool's slots keep their control files open unless that could take a good part
        # of the fds (at most a quarter of the soft limit)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        wanted = size * (len(KEPT_FILES) + 1 + len(CONTROLLERS))  # + the CPU usage file
        self.keep_fds = soft == resource.RLIM_INFINITY or wanted <= soft // 4

    @property
    def available(self) -> bool:
        return bool(self.bases)

    @property
    def controllers(self) -> list[str]:
        return list(self.bases)

    def start(self) -> None:
        own = _own_cgroup_paths()
        mounts: set[Path] = set()
        for c in CONTROLLERS:
            mount = CGROUP_ROOT / c
            if not (mount / "cgroup.procs").exists() or c not in own:
                continue
            if mount.resolve() in mounts:  # co-mounted with one already used (cpu,cpuacct)
                continue
            mounts.add(mount.resolve())
            parent = mount / own[c].lstrip("/")
            self._reap_stale(parent)
            try:
                base = self._claim(parent)
                if c == "memory":
                    with contextlib.suppress(OSError):
                        write_control(base / "memory.use_hierarchy", "1")
                elif c == "cpu":
                    set_cpu_weight(base, self.group_cpu_shares)
            except OSError as exc:
                self.unavailable_reason = f"cannot create a cgroup under {parent}: {exc}"
                continue
            self.bases[c] = base
        if not self.bases:
            self.unavailable_reason = self.unavailable_reason or "no cgroup v1 controllers mounted"
            return
        for _ in range(self.size):
            self._free.append(slot := self._create())
            if self.keep_fds:
                slot.open_fds()

    def _claim(self, parent: Path) -> Path:
        """This instance's base under `parent`, named with its pid, locked for its lifetime."""
        base, fd = claim_instance_dir(parent)
        self._locks.append(fd)
        return base

    @staticmethod
    def _reap_stale(parent: Path) -> None:
        """Remove cgroups left by an earlier instance that died without closing."""
        reap_dead_instances(parent, _kill_and_remove_children)

    def _create(self) -> CgroupSlot:
        self._counter += 1
        name = f"run-{self._counter}"
        dirs: dict[str, Path] = {}
        for c, base in self.bases.items():
            d = base / name
            d.mkdir(exist_ok=True)
            if c == "cpu":
                set_cpu_weight(d, self.cpu_shares)
            dirs[c] = d
        slot = CgroupSlot(name, dirs, _cpu_file=cpu_usage_file(dirs))
        slot.reset()
        return slot

    def acquire(self) -> CgroupSlot | None:
        if not self.bases:
            return None
        return self._free.pop() if self._free else self._create()

    def release(self, slot: CgroupSlot) -> None:
        """Back to the pool if empty; else kill what is left and drain it in the background."""
        if slot.task_count() == 0:
            slot.reset()
            if len(self._free) < self.size:
                self._free.append(slot)
            else:
                slot.remove()
            return
        slot.kill_all()
        task = asyncio.get_running_loop().create_task(self._drain(slot))
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    async def _drain(self, slot: CgroupSlot, timeout: float = 10.0) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while slot.task_count() and loop.time() < end:
            slot.kill_all()
            await asyncio.sleep(0.01)
        slot.remove()

    @property
    def draining(self) -> int:
        return len(self._draining)

    async def close(self) -> None:
        if self._draining:
            await asyncio.gather(*self._draining, return_exceptions=True)
        for slot in self._free:
            slot.kill_all()
            slot.remove()
        self._free.clear()
        for base in self.bases.values():
            if base.exists():
                _kill_and_remove_children(base)
        for fd in self._locks:
            os.close(fd)
        self._locks.clear()


def _kill_and_remove_children(parent: Path) -> None:
    """SIGKILL every task in each child cgroup of `parent`, remove the children, then `parent`."""
    with contextlib.suppress(OSError):
        for sub in list(parent.iterdir()):
            if sub.is_dir():
                with contextlib.suppress(OSError):
                    for task in read_control(sub / "cgroup.procs").split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(task), signal.SIGKILL)
                    sub.rmdir()
    with contextlib.suppress(OSError):
        parent.rmdir()
