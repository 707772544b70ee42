"""How a step ended, from its exit status, why it was killed and what its cgroup saw."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from ..models import ExecStatus
from .cgroup_slot import CgroupStats
from .limits import StepLimits

CORES = os.cpu_count() or 1
# no process gets SIGXCPU before a second of CPU time: the kernel makes a CPU rlimit of 0 one
# second (a tick of slack for the accounting)
MIN_SIGXCPU_CPU_S = 0.9


@dataclass(frozen=True, slots=True)
class Ending:
    status: ExecStatus
    exit_code: int | None
    signal: int | None
    message: str


def classify(
    returncode: int | None,
    *,
    isolated: bool,
    killed: tuple[ExecStatus, str] | None,
    stats: CgroupStats | None,
    lim: StepLimits,
    cpu_time_s: float | None,
    wall_s: float,
) -> Ending:
    """The status a step is reported with: a kill by the service names its reason; else the
    memory cgroup, the CPU rlimit (SIGXCPU at its soft limit, SIGKILL at the hard one) and
    SIGXFSZ explain a death; else it finished by itself."""
    rc = returncode
    exit_code: int | None = rc
    sig: int | None = None
    if rc is not None and rc < 0:  # bwrap (or a direct child) itself killed
        sig = -rc
    elif isolated and rc is not None and 128 < rc <= 128 + 64:
        sig = rc - 128  # bwrap (and the fork server) report a signal death as 128 + signal
    if sig is not None:
        exit_code = -sig
    status, message = ExecStatus.FINISHED, ""
    if killed is not None:
        status, message = killed
    elif stats is not None and (
        stats.oom_killed or (stats.hit_memory_limit and rc != 0 and _near_memory_limit(stats, lim))
    ):
        status = ExecStatus.MEMORY_LIMIT
        message = f"memory limit of {lim.memory_bytes // (1 << 20)} MB exceeded"
    elif (
        sig == signal.SIGXCPU
        and wall_s * CORES >= lim.cpu_s
        and (cpu_time_s is None or cpu_time_s >= MIN_SIGXCPU_CPU_S)
    ):
        # the soft CPU rlimit; bwrap reports it as an exit(152) would be, and no program spends
        # cpu_s of CPU time in less wall time than that on this host's cores. Its CPU time tells
        # an exit(152) apart: `sleep 2; exit 152` read "CPU-time limit of 4 s exceeded" beside a
        # cpu_time of 0.003 s (on a 64-core host, any exit(152) after 0.2 s of a 10 s run).
        status = ExecStatus.TIME_LIMIT
        message = f"CPU-time limit of {lim.cpu_s} s exceeded"
    elif (
        sig == signal.SIGKILL
        and stats is not None
        and cpu_time_s is not None
        and cpu_time_s >= lim.cpu_s - 1.5
    ):
        status = ExecStatus.TIME_LIMIT
        message = f"CPU-time limit of {lim.cpu_s} s exceeded"
    elif sig == signal.SIGXFSZ:
        message = "file size limit exceeded"
    return Ending(status, exit_code, sig, message)


def _near_memory_limit(stats: CgroupStats, lim: StepLimits) -> bool:
    """A failing program that pushed against its memory limit (not just page-cache reclaim)."""
    if stats.peak_memory_kb is None:
        return False
    return stats.peak_memory_kb * 1024 >= 0.8 * lim.memory_bytes
