"""One run's cgroup (`CgroupSlot`): its control files, limits, counters and how a process joins.

`cgroups.CgroupPool` makes the slots and hands them out; a slot is one directory per v1
controller, read and written here through fds kept open across runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

CFS_PERIOD_US = 100_000


def write_control(path: Path | str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def read_control(path: Path | str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536).decode()
    finally:
        os.close(fd)


def cpu_usage_file(dirs: dict[str, Path]) -> tuple[str, str] | None:
    """(controller, file) holding a slot's CPU usage: v1's cpuacct.usage (in its own dir or,
    co-mounted, in the cpu dir), or v2's cpu.stat (in every v2 cgroup, with `usage_usec`)."""
    for c in ("cpuacct", "cpu"):
        if c in dirs and (dirs[c] / "cpuacct.usage").exists():
            return c, "cpuacct.usage"
    if "cpu" in dirs and not (dirs["cpu"] / "cpu.shares").exists():  # a v2 cgroup
        return "cpu", "cpu.stat"
    return None


def parse_cpu_usage_us(name: str, text: str) -> int | None:
    """Microseconds of CPU from cpuacct.usage (nanoseconds) or cpu.stat's `usage_usec` line."""
    if name == "cpuacct.usage":
        return int(text) // 1000
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            return int(value)
    return None


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
)  # and the slot's CPU usage file (`cpu_usage_file`), and each dir's JOIN_FILE, for writing


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
    _cpu_file: tuple[str, str] | None = field(default=None, repr=False)  # `cpu_usage_file`
    _cpu_baseline_us: int = field(default=0, repr=False)  # CPU usage at reset
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
        """Open and keep the control files of `KEPT_FILES` (those of its controllers), its CPU
        usage file (wherever the layout puts it) and its join files."""
        usage = [(*self._cpu_file, os.O_RDONLY)] if self._cpu_file is not None else []
        joins = ((c, JOIN_FILE, os.O_WRONLY) for c in self.dirs)
        try:
            for c, name, flags in (*KEPT_FILES, *usage, *joins):
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

    @property
    def fork_server_controllers(self) -> list[str]:
        """The controllers a fork-server process joins: all but cpuacct. Its CPU time comes from
        the zygote (the runner's rusage), so joining cpuacct too would be one more migration
        per runner for a figure no one reads."""
        return [c for c in self.dirs if c != "cpuacct"]

    def join_fds(self) -> list[int]:
        """An fd open for writing on each `fork_server_controllers`' `JOIN_FILE`, through which
        a fork-server process joins the slot by writing "0"; hand them back with
        `done_join_fds`."""
        return [self._fd(c, JOIN_FILE, os.O_WRONLY) for c in self.fork_server_controllers]

    def done_join_fds(self, fds: list[int]) -> None:
        for c, fd in zip(self.fork_server_controllers, fds, strict=True):
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
                    write_control(memsw, "-1")
                write_control(mem / "memory.limit_in_bytes", value)
                write_control(memsw, value)
            else:
                write_control(mem / "memory.limit_in_bytes", value)
            self._memory_limit = memory_bytes
        pids = self.dirs.get("pids")
        if pids is not None and pids_max != self._pids_max:
            write_control(pids / "pids.max", str(pids_max) if pids_max else "max")
            self._pids_max = pids_max
        cpu = self.dirs.get("cpu")
        if cpu is not None:
            quota = int(cpu_cores * CFS_PERIOD_US) if cpu_cores else -1
            if quota != self._cpu_quota:
                write_control(cpu / "cpu.cfs_period_us", str(CFS_PERIOD_US))
                write_control(cpu / "cpu.cfs_quota_us", str(quota))
                self._cpu_quota = quota

    def attach(self, pid: int) -> None:
        """Move `pid` (not yet running user code) into this slot, every controller."""
        for d in self.dirs.values():
            write_control(d / "cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        d = self.dirs.get("pids") or next(iter(self.dirs.values()))
        return [int(p) for p in read_control(self.control_file(d, "cgroup.procs")).split()]

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

    def _cpu_usage_us(self) -> int | None:
        """CPU time charged to the slot, ever (None without CPU accounting)."""
        if self._cpu_file is None:
            return None
        return parse_cpu_usage_us(self._cpu_file[1], self._pread(*self._cpu_file))

    def cpu_time_s(self) -> float | None:
        """CPU time of every task the slot has held since `reset` (None without accounting)."""
        used = self._cpu_usage_us()
        return None if used is None else max(used - self._cpu_baseline_us, 0) / 1e6

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
        The CPU time is measured above what was charged at reset, as that cannot be zeroed
        under v2.
        """
        self._cpu_baseline_us = self._cpu_usage_us() or 0
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
