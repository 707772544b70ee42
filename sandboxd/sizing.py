"""How many programs sandboxd admits at once when `max_concurrency` is left at 0.

A program that sleeps or waits on I/O holds no core, so counting programs in flight against the
number of cores makes sleepers delay CPU work for nothing (four `sleep(3)` programs held every
slot of a 2-core host). The limit is on programs in flight instead: several per core (the
kernel's scheduler shares the cores among the CPU-bound ones), and never more than the memory
can hold if each used its default memory limit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

PROGRAMS_PER_CORE = 4
MEMORY_SHARE = 0.5  # of the machine's memory, for programs at their default memory limit


@dataclass(frozen=True, slots=True)
class Sizing:
    cores: int
    memory_mb: int
    per_run_mb: int

    @property
    def by_cpu(self) -> int:
        return PROGRAMS_PER_CORE * self.cores

    @property
    def by_memory(self) -> int:
        return int(self.memory_mb * MEMORY_SHARE) // self.per_run_mb

    @property
    def limit(self) -> int:
        return max(2, min(self.by_cpu, self.by_memory))

    def describe(self) -> str:
        return (
            f"{self.limit} programs in flight: min({PROGRAMS_PER_CORE} x {self.cores} cores, "
            f"{MEMORY_SHARE:g} x {self.memory_mb} MB memory / {self.per_run_mb} MB per program)"
        )


def host_sizing(per_run_mb: int) -> Sizing:
    """This host's cores (those this process may run on) and physical memory."""
    cores = len(os.sched_getaffinity(0)) or 1
    memory_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (1 << 20)
    return Sizing(cores=cores, memory_mb=memory_mb, per_run_mb=per_run_mb)
