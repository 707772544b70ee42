"""Where a machine's CPU went over a window, from /proc: the arithmetic of
`benchmarks.fork_server_budget`, kept apart so that it can be tested on made-up /proc text.

Two snapshots (`/proc/stat` and every `/proc/<pid>/stat`) bound a window. A group of user
processes is charged, at each end, the CPU of its live members plus what they reaped
(utime + stime + cutime + cstime): a process that exits and is reaped in the window moves its
whole time into its reaper's cutime, so the difference of the two sums is exact for a group
whose reaper lives. Kernel threads are nobody's children: a kernel thread is charged its
difference when it lives at both ends, its whole time when it was born in the window, and
nothing when it died in it (those are counted as missed). What no process accounts for (irq
and softirq time outside any task, kernel threads that died, rounding to clock ticks) is left
as `unattributed`.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
# /proc/stat cpu columns: user nice system idle iowait irq softirq steal guest guest_nice;
# guest time is already inside user and nice
BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)
IDLE_COLUMNS = (3, 4)
KTHREADD = 2
KERNEL_GROUPS = ("kworker", "ksoftirqd", "rcu")
LOADGEN = "load generator (this process)"
BARE = "bare python -c (its reaped children)"
SERVER = "sandboxd server"
TREE = "sandbox tree (bwrap, zygote, runners)"
ZYGOTE = "sandbox tree: bwrap and zygote (own)"
RUNNERS = "sandbox tree: runners (live and reaped)"
OTHER = "everything else (other users)"
UNATTRIBUTED = "unattributed (irq, dead kthreads, rounding)"
ORDER = (
    LOADGEN, BARE, SERVER, TREE, ZYGOTE, RUNNERS, *(f"kernel: {k}*" for k in KERNEL_GROUPS),
    "kernel: other threads", UNATTRIBUTED, OTHER,
)  # fmt: skip


@dataclass(frozen=True)
class Proc:
    """One /proc/<pid>/stat, in clock ticks."""

    pid: int
    comm: str
    ppid: int
    starttime: int
    own: int  # utime + stime (all threads)
    reaped: int  # cutime + cstime (children waited for)

    @property
    def kernel_thread(self) -> bool:
        return self.pid == KTHREADD or self.ppid == KTHREADD


@dataclass(frozen=True)
class Snapshot:
    cpus: dict[str, tuple[int, int]]  # "cpu", "cpu0", ...: (busy ticks, busy + idle ticks)
    procs: dict[int, Proc]


def parse_cpu_lines(text: str) -> dict[str, tuple[int, int]]:
    """The `cpu` and `cpuN` lines of /proc/stat: (busy, busy + idle) ticks each."""
    out: dict[str, tuple[int, int]] = {}
    for line in text.splitlines():
        if not line.startswith("cpu"):
            continue
        name, *values = line.split()
        ticks = [int(v) for v in values] + [0] * (8 - len(values))
        busy = sum(ticks[i] for i in BUSY_COLUMNS)
        out[name] = (busy, busy + sum(ticks[i] for i in IDLE_COLUMNS))
    return out


def parse_pid_stat(text: str) -> Proc:
    """One /proc/<pid>/stat line (the command name may hold spaces and parentheses)."""
    head, tail = text.split(" (", 1)
    comm, rest = tail.rsplit(") ", 1)
    f = rest.split()  # f[0] is field 3 (state)
    return Proc(
        pid=int(head),
        comm=comm,
        ppid=int(f[1]),
        starttime=int(f[19]),
        own=int(f[11]) + int(f[12]),
        reaped=int(f[13]) + int(f[14]),
    )


def snapshot(proc: Path = Path("/proc")) -> Snapshot:
    """/proc/stat and every process's stat, now (processes that vanish meanwhile are skipped)."""
    cpus = parse_cpu_lines((proc / "stat").read_text())
    procs: dict[int, Proc] = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            p = parse_pid_stat(Path(entry.path, "stat").read_text())
        except (FileNotFoundError, ProcessLookupError):
            continue
        procs[p.pid] = p
    return Snapshot(cpus, procs)


def descendants(procs: dict[int, Proc], root: int) -> dict[int, int]:
    """Every live process below `root` (not `root` itself), with its depth (children: 1)."""
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out: dict[int, int] = {}
    todo = [(pid, 1) for pid in children.get(root, [])]
    while todo:
        pid, depth = todo.pop()
        if pid not in out:
            out[pid] = depth
            todo.extend((child, depth + 1) for child in children.get(pid, []))
    return out


def kernel_group(comm: str) -> str:
    for prefix in KERNEL_GROUPS:
        if comm.startswith(prefix):
            return f"kernel: {prefix}*"
    return "kernel: other threads"


def _user_groups(
    snap: Snapshot, bench: int, server: int | None, others: dict[str, int] | None = None
) -> dict[str, int]:
    """Ticks charged to each user-process group at one end (live members plus their reaped);
    `others` gets the other users' part by command name."""
    out: dict[str, int] = {}
    others = {} if others is None else others

    def add(group: str, ticks: int) -> None:
        out[group] = out.get(group, 0) + ticks

    tree = descendants(snap.procs, server) if server is not None else {}
    for p in snap.procs.values():
        if p.kernel_thread:
            continue
        if p.pid == bench:
            add(LOADGEN, p.own)
            add(BARE, p.reaped)
        elif p.pid == server:
            add(SERVER, p.own)
            add(TREE, p.reaped)  # replaced zygotes, with their bwrap and runners
        elif p.pid in tree:
            add(TREE, p.own + p.reaped)
        else:
            add(OTHER, p.own + p.reaped)
            others[p.comm] = others.get(p.comm, 0) + p.own + p.reaped
    return out


def account(
    before: Snapshot, after: Snapshot, bench: int, server: int | None = None
) -> dict[str, object]:
    """Ticks per group over the window, the machine's busy ticks (all CPUs and each), what is
    left unattributed and how many kernel threads died unseen."""
    groups: dict[str, int] = {}
    others_start: dict[str, int] = {}
    others_end: dict[str, int] = {}
    start = _user_groups(before, bench, server, others_start)
    end = _user_groups(after, bench, server, others_end)
    others = {k: v - others_start.get(k, 0) for k, v in others_end.items()}
    for name in sorted(set(start) | set(end)):
        groups[name] = end.get(name, 0) - start.get(name, 0)
    missed = 0
    for p in before.procs.values():
        if p.kernel_thread:
            q = after.procs.get(p.pid)
            if q is None or q.starttime != p.starttime:
                missed += 1
    for q in after.procs.values():
        if not q.kernel_thread:
            continue
        p = before.procs.get(q.pid)
        born = p is None or p.starttime != q.starttime
        ticks = q.own + q.reaped - (0 if born else p.own + p.reaped)  # type: ignore[union-attr]
        name = kernel_group(q.comm)
        groups[name] = groups.get(name, 0) + ticks
    busy = {
        name: (after.cpus[name][0] - b[0], after.cpus[name][1] - b[1])
        for name, b in before.cpus.items()
        if name in after.cpus
    }
    return {
        "groups_ticks": groups,
        "busy_ticks": busy["cpu"][0],
        "elapsed_ticks": busy["cpu"][1],
        "per_cpu_busy_share": {
            n: round(b / t, 3) if t else 0.0 for n, (b, t) in busy.items() if n != "cpu"
        },
        "unattributed_ticks": busy["cpu"][0] - sum(groups.values()),
        "kernel_threads_died_unseen": missed,
        "other_users_top_ticks": dict(sorted(others.items(), key=lambda kv: -kv[1])[:5]),
    }


def own_ticks(first: dict[tuple[int, int], Proc], last: dict[tuple[int, int], Proc]) -> int:
    """The own CPU (not their reaped children's) that processes spent between their `first`
    sample (none: born since, from 0) and their `last`, keyed by (pid, starttime)."""
    return sum(q.own - (first[k].own if k in first else 0) for k, q in last.items())


def read_children(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """The live children of every thread of `pid` (none if it is gone)."""
    out: list[int] = []
    try:
        for task in os.scandir(proc / str(pid) / "task"):
            out += [int(c) for c in Path(task.path, "children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


class TopSampler(threading.Thread):
    """Samples the server's children and grandchildren (bwrap and the zygote) every
    `period_s`. The service replaces its zygote every `fork_server_max_forks` runs; a replaced
    one is reaped with its runners' time folded into the server's cutime, so its own CPU is
    known only up to its last sample (what it spent after that is charged to the runners)."""

    def __init__(self, server: int, period_s: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.server, self.period_s = server, period_s
        self.last: dict[tuple[int, int], Proc] = {}
        self._stop_event = threading.Event()

    def sample(self) -> dict[tuple[int, int], Proc]:
        out: dict[tuple[int, int], Proc] = {}
        for child in read_children(self.server):
            for pid in [child, *read_children(child)]:
                try:
                    p = parse_pid_stat(Path(f"/proc/{pid}/stat").read_text())
                except (FileNotFoundError, ProcessLookupError):
                    continue
                out[(p.pid, p.starttime)] = p
        return out

    def run(self) -> None:
        while not self._stop_event.wait(self.period_s):
            self.last.update(self.sample())

    def stop(self) -> dict[tuple[int, int], Proc]:
        """Stop, take a last sample and return the last one of each process seen."""
        self._stop_event.set()
        self.join()
        self.last.update(self.sample())
        return self.last
