"""One step's limits, and how they are put on a sandboxed process: its cgroup and rlimits."""

from __future__ import annotations

import asyncio
import math
import resource
from concurrent.futures import Executor
from dataclasses import dataclass

from toolenv_core.deadline import Deadline

from ..models import Limits
from ..settings import SandboxSettings
from .cgroup_slot import CgroupSlot


@dataclass(frozen=True, slots=True)
class StepLimits:
    """A step's limits resolved against the settings and the request's deadline."""

    wall_s: float  # the step's own timeout, or what is left of the deadline when that is less
    cpu_s: int
    memory_bytes: int
    pids: int
    nofile: int
    fsize_bytes: int
    output_bytes: int
    cpu_cores: float | None
    own_wall_s: float  # the step's own timeout (`wall_s` without the deadline)

    @classmethod
    def resolve(cls, settings: SandboxSettings, limits: Limits, deadline: Deadline) -> StepLimits:
        s = settings
        mem_mb = limits.memory_mb or s.default_memory_mb
        return cls(
            wall_s=min(limits.wall_time_s, deadline.remaining()),
            cpu_s=math.ceil(limits.cpu_time_s or limits.wall_time_s) + 1,
            memory_bytes=mem_mb * 1024 * 1024,
            pids=limits.max_processes or s.max_processes,
            nofile=limits.max_open_files or s.max_open_files,
            fsize_bytes=(limits.max_file_size_mb or s.max_file_size_mb) * 1024 * 1024,
            output_bytes=limits.max_output_bytes or s.default_output_bytes,
            cpu_cores=limits.cpu_limit,
            own_wall_s=limits.wall_time_s,
        )

    def time_limit_message(self, used_s: float) -> str:
        """Which limit ended a step at `wall_s`: its own timeout, or the request's deadline (it
        said "wall-clock limit of 0.0196 s exceeded" for a run_timeout of 10 s that the deadline
        cut), in the Docker backend's words."""
        if self.wall_s >= self.own_wall_s:
            return f"wall-clock limit of {self.own_wall_s:.3g} s exceeded"
        return (
            f"the request deadline ended it after {used_s:.3g} s "
            f"(its own limit: {self.own_wall_s:.3g} s)"
        )

    def rlimits(self, with_cgroup_memory: bool) -> list[tuple[int, int, int]]:
        """(resource, soft, hard) for each rlimit. With the memory cgroup bounding resident
        memory, the address-space limit only has to stop absurd allocations early; without it,
        it is the memory limit. The CPU limit is soft `cpu_s` (SIGXCPU, which names the limit in
        the exit status: a program under bwrap's init is reaped there, so the service has no CPU
        time of its own to tell a CPU-limit SIGKILL by) and hard one second later (SIGKILL, for
        a program that ignores SIGXCPU, or is its namespace's init, which the kernel spares it),
        as the Docker agent sets it. glibc reserves each thread a stack of the stack rlimit, so
        the address space has room for one per process the run may have: a C program made 5
        threads at the default 512 MB ("Resource temporarily unavailable")."""
        stack = min(self.memory_bytes, 256 << 20)
        address_space = (
            self.memory_bytes * 2 + (512 << 20) + self.pids * stack
            if with_cgroup_memory
            else self.memory_bytes
        )
        same = [
            (resource.RLIMIT_AS, address_space),
            (resource.RLIMIT_FSIZE, self.fsize_bytes),
            (resource.RLIMIT_NOFILE, self.nofile),
            (resource.RLIMIT_CORE, 0),
            (resource.RLIMIT_STACK, stack),
        ]
        return [
            (resource.RLIMIT_CPU, self.cpu_s, self.cpu_s + 1),
            *((res, value, value) for res, value in same),
        ]


def has_memory_cgroup(slot: CgroupSlot | None) -> bool:
    return slot is not None and "memory" in slot.dirs


async def confine(
    pid: int,
    slot: CgroupSlot | None,
    lim: StepLimits,
    writer: Executor,
    join: bool,
) -> None:
    """Move `pid` into `slot` (unless `join` is False: it is in already) and set its rlimits.

    A task migration can wait on an RCU grace period: it runs on `writer`, off the event loop.
    Raises OSError / ValueError when the process is gone or a limit cannot be set.
    """
    if slot is not None and join:
        await asyncio.get_running_loop().run_in_executor(writer, slot.attach, pid)
    for res, soft, hard in lim.rlimits(has_memory_cgroup(slot)):
        resource.prlimit(pid, res, (soft, hard))
