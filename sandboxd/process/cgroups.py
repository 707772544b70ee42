"""Per-run cgroups (v1): pids.max against fork bombs, memory limit and peak, CPU weight and quota.

Each run gets one `CgroupSlot`: a directory per controller, nested under the service's own
cgroup (so whatever bounds the service also bounds its programs). Slots are created once and
reused through a pool, because mkdir/rmdir of four cgroup directories per run would cost more
than the rest of the per-run bookkeeping. A slot goes back to the pool only when it is empty
(no task left), with its counters reset; one that cannot be emptied is killed again and removed.
At start-up, directories left by a crashed earlier instance (named with a pid that no longer
runs) are removed.

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
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PREFIX = "toolenv-sandboxd-"
# cpuacct is left out on purpose: every cgroup.procs write is a task migration, which can stall
# for milliseconds on a busy host (it waits on an RCU grace period); CPU time comes from wait4.
CONTROLLERS = ("pids", "memory", "cpu")
MAX_SHARES = 262144  # the kernel's bound on cpu.shares
CFS_PERIOD_US = 100_000
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


def _write(path: Path | str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read(path: Path | str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536).decode()
    finally:
        os.close(fd)


def set_cpu_weight(d: Path, shares: int) -> None:
    """cpu.shares (v1) of `d`, or the equivalent cpu.weight (v2, systemd's mapping)."""
    shares = max(2, min(shares, MAX_SHARES))
    if (d / "cpu.shares").exists():
        _write(d / "cpu.shares", str(shares))
    else:
        _write(d / "cpu.weight", str(1 + (shares - 2) * 9999 // (MAX_SHARES - 2)))


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


@dataclass
class CgroupStats:
    peak_memory_kb: int | None = None
    oom_killed: bool = False
    hit_memory_limit: bool = False


# How a fork-server process (single-threaded: a runner or a case, before any user code) joins
# its slot: "0" written to each controller's `tasks` moves the writer's only thread, which is
# the whole process. Not `cgroup.procs`: a process migration write-locks the global threadgroup
# rwsem, which waits for an RCU grace period when the lock was idle (about 8 ms for three
# controllers here, and every fork on the host waits behind it); the kernel moves the calling
# thread alone without that lock.
JOIN_FILE = "tasks"
# opened once per slot of the pool, for the reads and writes of every run (cgroup.procs is
# read afresh by opening it: a `pread` of a kept fd does not list its tasks again)
KEPT_FILES = (
    ("memory", "memory.max_usage_in_bytes", os.O_RDONLY),
    ("memory", "memory.max_usage_in_bytes", os.O_WRONLY),
    ("memory", "memory.stat", os.O_RDONLY),
    ("memory", "memory.oom_control", os.O_RDONLY),
    ("memory", "memory.failcnt", os.O_RDONLY),
    ("pids", "pids.current", os.O_RDONLY),
    *((c, JOIN_FILE, os.O_WRONLY) for c in CONTROLLERS),
)


@dataclass
class CgroupSlot:
    """One run's cgroup directories, one per available controller.

    A slot of the pool keeps the control files a run reads or writes open (`open_fds`): an open
    of a cgroup file costs about 7 us of the service's CPU, a `pread` at offset 0 (the kernel
    shows the file afresh) under 1 us, and a run touches a dozen of them. A slot made when the
    pool ran dry opens them per use (its fds would outlive the burst that made it).
    """

    name: str
    dirs: dict[str, Path]
    _memory_limit: int | None = field(default=None, repr=False)
    _pids_max: int | None = field(default=None, repr=False)
    _cpu_quota: int = field(default=-1, repr=False)
    _oom_kills: int = field(default=0, repr=False)
    _failcnt: int = field(default=0, repr=False)
    _baseline: int = field(default=0, repr=False)  # user pages charged at reset (see `reset`)
    _files: dict[tuple[Path, str], str] = field(default_factory=dict, repr=False)
    _fds: dict[tuple[str, str, int], int] = field(default_factory=dict, repr=False)

    def control_file(self, d: Path, name: str) -> str:
        """A control file's path, joined once (several are read for every run)."""
        key = (d, name)
        path = self._files.get(key)
        if path is None:
            path = self._files[key] = f"{d}/{name}"
        return path

    def open_fds(self) -> None:
        """Open and keep the control files of `KEPT_FILES` (those of its controllers)."""
        try:
            for c, name, flags in KEPT_FILES:
                if (d := self.dirs.get(c)) is not None:
                    fd = os.open(self.control_file(d, name), flags | os.O_CLOEXEC)
                    self._fds[(c, name, flags)] = fd
        except OSError:
            self.close_fds()  # per use, as without the pool
            raise

    def close_fds(self) -> None:
        """Close the kept fds (before the dirs are removed)."""
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def _fd(self, c: str, name: str, flags: int) -> int:
        """A kept fd on a control file, or a fresh one (`_done` closes only those)."""
        fd = self._fds.get((c, name, flags))
        if fd is None:
            fd = os.open(self.control_file(self.dirs[c], name), flags | os.O_CLOEXEC)
        return fd

    def _done(self, c: str, name: str, flags: int, fd: int) -> None:
        if self._fds.get((c, name, flags)) != fd:
            os.close(fd)

    def _pread(self, c: str, name: str) -> str:
        fd = self._fd(c, name, os.O_RDONLY)
        try:
            return os.pread(fd, 65536, 0).decode()
        finally:
            self._done(c, name, os.O_RDONLY, fd)

    def _pwrite(self, c: str, name: str, value: str) -> None:
        fd = self._fd(c, name, os.O_WRONLY)
        try:
            os.pwrite(fd, value.encode(), 0)
        finally:
            self._done(c, name, os.O_WRONLY, fd)

    def join_fds(self) -> list[int]:
        """An fd open for writing on each controller's `JOIN_FILE`, through which a fork-server
        process joins the slot by writing "0"; hand them back with `done_join_fds`."""
        return [self._fd(c, JOIN_FILE, os.O_WRONLY) for c in self.dirs]

    def done_join_fds(self, fds: list[int]) -> None:
        for c, fd in zip(self.dirs, fds, strict=True):
            self._done(c, JOIN_FILE, os.O_WRONLY, fd)

    def configure(
        self, *, memory_bytes: int | None, pids_max: int | None, cpu_cores: float | None
    ) -> None:
        """Set this run's limits (only the files whose value changes are written)."""
        mem = self.dirs.get("memory")
        if mem is not None and memory_bytes != self._memory_limit:
            value = str(memory_bytes) if memory_bytes else "-1"
            # memsw must stay >= limit: raise memsw first when growing, lower it last when shrinking.
            memsw = mem / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                with contextlib.suppress(OSError):
                    _write(memsw, "-1")
                _write(mem / "memory.limit_in_bytes", value)
                _write(memsw, value)
            else:
                _write(mem / "memory.limit_in_bytes", value)
            self._memory_limit = memory_bytes
        pids = self.dirs.get("pids")
        if pids is not None and pids_max != self._pids_max:
            _write(pids / "pids.max", str(pids_max) if pids_max else "max")
            self._pids_max = pids_max
        cpu = self.dirs.get("cpu")
        if cpu is not None:
            quota = int(cpu_cores * CFS_PERIOD_US) if cpu_cores else -1
            if quota != self._cpu_quota:
                _write(cpu / "cpu.cfs_period_us", str(CFS_PERIOD_US))
                _write(cpu / "cpu.cfs_quota_us", str(quota))
                self._cpu_quota = quota

    def attach(self, pid: int) -> None:
        """Move `pid` (not yet running user code) into this slot, every controller."""
        for d in self.dirs.values():
            _write(d / "cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        d = self.dirs.get("pids") or next(iter(self.dirs.values()))
        return [int(p) for p in _read(self.control_file(d, "cgroup.procs")).split()]

    def task_count(self) -> int:
        """Tasks still charged to the slot (zombies included, unlike cgroup.procs)."""
        pids = self.dirs.get("pids")
        if pids is not None:
            return int(self._pread("pids", "pids.current"))
        return len(self.pids())

    def kill_all(self) -> int:
        """SIGKILL every task in the slot (the backstop behind killing the namespace)."""
        n = 0
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                n += 1
        return n

    def stats(self) -> CgroupStats:
        out = CgroupStats()
        if "memory" in self.dirs:
            peak = int(self._pread("memory", "memory.max_usage_in_bytes")) - self._baseline
            out.peak_memory_kb = max(peak, 0) // 1024
            oom = 0
            for line in self._pread("memory", "memory.oom_control").splitlines():
                if line.startswith("oom_kill "):
                    oom = int(line.split()[1])
            failcnt = int(self._pread("memory", "memory.failcnt"))
            out.oom_killed = oom > self._oom_kills
            out.hit_memory_limit = failcnt > self._failcnt
        return out

    def reset(self) -> None:
        """Zero the counters so the next run reads only its own figures.

        The peak is measured above the pages earlier runs left charged (page cache, a waiting
        sandbox's own pages), read from `memory.stat`, not above the whole usage counter: that
        also holds the kernel's per-CPU precharge (up to 64 pages per CPU, which the next
        program's first pages use without the counter moving) and kernel memory of the last
        step that is freed some milliseconds later. Subtracting those made a program's own
        first few hundred KB vanish (a small C program reported 0, 8 MB reported 7.8 MB);
        left in, they count towards the run's peak instead (at most a few hundred KB).
        """
        if "memory" in self.dirs:
            self._pwrite("memory", "memory.max_usage_in_bytes", "0")
            self._baseline = _user_pages(self._pread("memory", "memory.stat"))
            for line in self._pread("memory", "memory.oom_control").splitlines():
                if line.startswith("oom_kill "):
                    self._oom_kills = int(line.split()[1])
            self._failcnt = int(self._pread("memory", "memory.failcnt"))

    def remove(self) -> bool:
        self.close_fds()
        ok = True
        for d in self.dirs.values():
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                ok = False
        return ok


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
        self.unavailable_reason: str | None = None
        # the pool's slots keep their control files open unless that could take a good part
        # of the fds (at most a quarter of the soft limit)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        wanted = size * len(KEPT_FILES)
        self.keep_fds = soft == resource.RLIM_INFINITY or wanted <= soft // 4

    @property
    def available(self) -> bool:
        return bool(self.bases)

    @property
    def controllers(self) -> list[str]:
        return list(self.bases)

    def start(self) -> None:
        own = _own_cgroup_paths()
        for c in CONTROLLERS:
            mount = CGROUP_ROOT / c
            if not (mount / "cgroup.procs").exists() or c not in own:
                continue
            parent = mount / own[c].lstrip("/")
            self._reap_stale(parent)
            base = parent / f"{PREFIX}{os.getpid()}"
            try:
                base.mkdir(exist_ok=True)
                if c == "memory":
                    with contextlib.suppress(OSError):
                        _write(base / "memory.use_hierarchy", "1")
                elif c == "cpu":
                    set_cpu_weight(base, self.group_cpu_shares)
            except OSError as exc:
                self.unavailable_reason = f"cannot create {base}: {exc}"
                continue
            self.bases[c] = base
        if not self.bases:
            self.unavailable_reason = self.unavailable_reason or "no cgroup v1 controllers mounted"
            return
        for _ in range(self.size):
            self._free.append(slot := self._create())
            if self.keep_fds:
                slot.open_fds()

    @staticmethod
    def _reap_stale(parent: Path) -> None:
        """Remove cgroups left by an earlier instance that died without closing."""
        with contextlib.suppress(OSError):
            for d in parent.glob(f"{PREFIX}*"):
                pid = d.name.removeprefix(PREFIX)
                if pid.isdigit() and _left_by_dead_instance(d, int(pid)):
                    _kill_and_remove_children(d)

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
        slot = CgroupSlot(name, dirs)
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


def _user_pages(stat: str) -> int:
    """Bytes of page cache (tmpfs included) and anonymous memory charged, from `memory.stat`."""
    total = 0
    for line in stat.splitlines():
        key, _, value = line.partition(" ")
        if key in ("cache", "rss"):
            total += int(value)
        elif key == "hierarchical_memory_limit":  # after every line of this cgroup's own
            break
    return total


def _kill_and_remove_children(parent: Path) -> None:
    """SIGKILL every task in each child cgroup of `parent`, remove the children, then `parent`."""
    with contextlib.suppress(OSError):
        for sub in list(parent.iterdir()):
            if sub.is_dir():
                with contextlib.suppress(OSError):
                    for task in _read(sub / "cgroup.procs").split():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(task), signal.SIGKILL)
                    sub.rmdir()
    with contextlib.suppress(OSError):
        parent.rmdir()
