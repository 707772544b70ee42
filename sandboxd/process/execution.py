"""One sandboxed process: spawn (or take a warm sandbox), confine, read output, enforce limits, reap.

The sandbox's PID namespace ends with the program: bwrap's init (or, for python, the program
itself as init) exits when the program does, and the kernel then kills and reaps everything else
in the namespace (so a setsid + double-fork daemon dies with it); bwrap reaps the program, so no
zombie is left for anybody. A deadline,
an output flood or a cancelled request SIGKILLs the program (the namespace follows) and, as a
backstop, every task still in the run's cgroup. stdout and stderr are read on the event loop (no
thread per run: `output.StepOutput`) up to `max_output_bytes` each; a program that writes more is
killed at once (`OutputLimitExceeded`), so a 1 GB flood costs a few milliseconds and a bounded
buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..languages import CHILD_ENV
from ..models import ExecResult, ExecStatus, output_limit_message
from .batch import CaseBatch
from .bwrap import Blocked, spawn_blocked
from .cgroup_slot import JOIN_FILE, CgroupSlot
from .ending import classify
from .forkserver import ForkedRun, ForkFailed, ForkServer, Runner
from .limits import StepLimits, confine, has_memory_cgroup
from .output import READ_CHUNK, StepOutput
from .warm import Warm

EXIT_GRACE_S = 2.0  # after a kill: how long bwrap may take to report before it is killed too


@dataclass(frozen=True, slots=True)
class ExecContext:
    """What an execution needs from the backend, and nothing more."""

    bwrap_prefix: list[str] | None  # None: insecure_no_isolation (a plain child process)
    cgroup_writer: Executor  # cgroup task migrations run here, off the event loop
    track: Callable[[Coroutine[Any, Any, None]], None]  # background reaping awaited at close
    fork_server: ForkServer | None = None  # python runs fork from its zygote when set

    @property
    def isolated(self) -> bool:
        return self.bwrap_prefix is not None


@dataclass(frozen=True, slots=True)
class Step:
    """What to run for one step, where, and under which limits."""

    argv: tuple[str, ...]
    workdir: Path
    lim: StepLimits
    slot: CgroupSlot | None
    stdin_fd: int  # a cold spawn's stdin (a file or /dev/null)
    stdin: bytes = b""  # a warm sandbox's stdin (written into its pipe)
    warm: Warm | None = None
    runner: Runner | None = None  # run it on this fork-server runner (python)
    batch: CaseBatch | None = None  # run it as one case of a run_tests request's runner
    as_init: bool = False  # a spawned program is its PID namespace's init (`bwrap.spawn_blocked`)


class Execution:
    """Runs one `Step` to its end; `cleanup()` leaves nothing of it behind."""

    def __init__(self, ctx: ExecContext, step: Step) -> None:
        self.ctx = ctx
        self.step = step
        self.lim = step.lim
        self.slot = step.slot
        self.loop = asyncio.get_running_loop()
        self.sandbox: Blocked | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.forked: ForkedRun | None = None
        self.returncode: int | None = None
        self.child_pid: int | None = None
        self.pidfd = -1
        self.fds: list[int] = []
        self.output = StepOutput(self.loop, self.lim.output_bytes, self._on_cap, self._maybe_done)
        self.over_cap: str | None = None  # the stream whose cap ended the step
        self.exited = False
        self.kill_reason: ExecStatus | None = None
        self.kill_message = ""
        self.done: asyncio.Future[None] = self.loop.create_future()
        self.timer: asyncio.TimerHandle | None = None
        self.started_at = 0.0
        self.ended_at = 0.0
        self.cpu_time_s: float | None = None

    # -------------------------------------------------------------- spawn

    async def run(self) -> ExecResult:
        step = self.step
        if self.ctx.bwrap_prefix is None:
            return await self._run_direct()
        if step.batch is not None:
            batch, slot = step.batch, self.slot
            return await self._run_forked(lambda req, fds: batch.fork(req, fds, slot))
        if step.runner is not None and self.ctx.fork_server is not None:
            server, runner = self.ctx.fork_server, step.runner
            return await self._run_forked(lambda req, fds: server.fork(runner, req, fds))
        try:
            if step.warm is not None:
                step.warm.used = True
                sandbox = step.warm.sandbox
                join = False  # a warm sandbox joined its slot ahead of time
            else:
                sandbox = await spawn_blocked(
                    self.ctx.bwrap_prefix, step.workdir, step.argv, step.stdin_fd, step.as_init
                )
                join = True
        except OSError as exc:
            return ExecResult(
                status=ExecStatus.ERROR, message=f"could not start the program: {exc}"
            )
        self.sandbox, self.proc, self.child_pid = sandbox, sandbox.proc, sandbox.child_pid
        if not await self._arm(sandbox, join):
            await self._wait_exit(EXIT_GRACE_S)
            return ExecResult(
                status=ExecStatus.ERROR,
                stderr=self.output.buffers["stderr"].decode(errors="replace"),
                message=self.kill_message or "the sandbox failed to start",
            )
        return await self._supervise(sandbox.out_r, sandbox.err_r)

    async def _arm(self, sandbox: Blocked, join: bool) -> bool:
        """Give the blocked sandbox this step's cgroup, limits and stdin, then let it exec."""
        if sandbox.child_pid is None:
            self.kill_message = "bwrap did not start the sandbox"
            return False
        try:
            await confine(sandbox.child_pid, self.slot, self.lim, self.ctx.cgroup_writer, join)
            if self.step.warm is not None and self.slot is not None:
                self.slot.reset()  # measure from here: the warm child's own charge is baseline
            sandbox.feed_stdin(self.step.stdin)  # a warm one's pipe: never blocks (size-checked)
            sandbox.unblock()
            return True
        except (OSError, ValueError) as exc:
            self.kill_message = f"could not apply limits: {exc}"
            sandbox.kill_child()
            return False

    async def _run_direct(self) -> ExecResult:
        """insecure_no_isolation: the program runs as a plain child (cgroup + rlimits only)."""
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        self.fds += [out_r, err_r]
        slot = self.slot
        procs_files = [str(d / JOIN_FILE) for d in slot.dirs.values()] if slot else []
        rlimits = self.lim.rlimits(has_memory_cgroup(slot))

        def enter_limits() -> None:  # runs in the child between fork and exec
            for path in procs_files:
                with open(path, "w") as f:
                    f.write("0")
            for res, soft, hard in rlimits:
                resource.setrlimit(res, (soft, hard))

        try:
            self.proc = subprocess.Popen(
                self.step.argv,
                stdin=self.step.stdin_fd,
                stdout=out_w,
                stderr=err_w,
                cwd=self.step.workdir,
                env=dict(CHILD_ENV),
                close_fds=True,
                start_new_session=True,
                preexec_fn=enter_limits,
            )
        except OSError as exc:
            return ExecResult(
                status=ExecStatus.ERROR, message=f"could not start the program: {exc}"
            )
        finally:
            os.close(out_w)
            os.close(err_w)
        self.child_pid = self.proc.pid
        return await self._supervise(out_r, err_r)

    async def _run_forked(
        self, launch: Callable[[dict[str, Any], list[int]], Awaitable[ForkedRun]]
    ) -> ExecResult:
        """Run on a fork-server runner (its program already waits in the slot's cgroup) or as
        a case of a batch: the process sets the rlimits and everything else itself before any
        user code."""
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        self.fds += [out_r, err_r]
        slot = self.slot
        request = {
            "workdir": self.step.workdir.name,
            "rlimits": self.lim.rlimits(has_memory_cgroup(slot)),
        }
        if slot is not None and self.step.batch is None:  # (a case's slot is fresh from the pool)
            slot.reset()  # measure from here: the waiting program's own charge is baseline
        self.started_at = time.monotonic()
        try:
            self.forked = await launch(request, [self.step.stdin_fd, out_w, err_w])
        except ForkFailed as exc:
            return ExecResult(status=ExecStatus.ERROR, message=f"fork server: {exc}")
        finally:
            os.close(out_w)
            os.close(err_w)
        if self.step.batch is None:  # a case's pid is its forker's, not ours: never signalled
            self.child_pid = self.forked.pid
        self.forked.ended.add_done_callback(self._on_fork_ended)
        return await self._supervise(out_r, err_r)

    async def _supervise(self, out_r: int, err_r: int) -> ExecResult:
        if self.forked is None:
            self.started_at = time.monotonic()
        self.output.read(out_r, err_r)
        if self.proc is not None:
            self.pidfd = os.pidfd_open(self.proc.pid)
            self.loop.add_reader(self.pidfd, self._on_exit)
        self.timer = self.loop.call_later(self.lim.wall_s, self._on_timeout)
        try:
            await self.done
        except asyncio.CancelledError:
            self.kill(ExecStatus.ERROR, "the request was cancelled")
            raise
        return self._result()

    # -------------------------------------------------------------- events

    def _on_cap(self, stream: str) -> None:
        if self.kill_reason is None:
            self.over_cap = stream
            self.kill(ExecStatus.OUTPUT_LIMIT, f"{stream} exceeded {self.lim.output_bytes} bytes")

    def _on_exit(self) -> None:
        self.loop.remove_reader(self.pidfd)
        assert self.proc is not None
        # wait4 rather than Popen.wait: the rusage carries the CPU time of the program and of
        # every descendant it (or, at namespace teardown, the kernel) reaped. Not so under
        # bwrap's own init: bwrap reports the exit status init read and exits without reaping
        # init (the kernel kills it), so its rusage is bwrap's alone (2 ms for a C program that
        # spun 0.6 s): the CPU time is then the run's cgroup's (unknown without one).
        under_bwrap_init = self.sandbox is not None and not self.step.as_init
        try:
            _, status, usage = os.wait4(self.proc.pid, 0)
            self.proc.returncode = os.waitstatus_to_exitcode(status)
            if not under_bwrap_init:
                self.cpu_time_s = usage.ru_utime + usage.ru_stime
        except ChildProcessError:  # reaped elsewhere: keep what Popen knows
            self.proc.poll()
        if under_bwrap_init and self.slot is not None:
            self.cpu_time_s = self.slot.cpu_time_s()
        self._exited(self.proc.returncode)

    def _on_fork_ended(self, ended: asyncio.Future[tuple[int, float] | str]) -> None:
        outcome = ended.result()
        if isinstance(outcome, str):  # the zygote failed around the program
            if self.kill_reason is None:
                self.kill(ExecStatus.ERROR, f"fork server: {outcome}")
            self._exited(None)
        else:
            self.cpu_time_s = outcome[1]
            self._exited(outcome[0])
        if self.ctx.fork_server is not None:
            self.ctx.fork_server.run_ended()

    def _exited(self, returncode: int | None) -> None:
        if self.exited:
            return
        self.ended_at = time.monotonic()
        self.returncode = returncode
        self.exited = True
        if self.slot is not None and self.slot.task_count():
            self.slot.kill_all()  # backstop (insecure mode: daemons; bwrap: nothing should be left)
        if self.kill_reason is not None:
            # Everything is dead: do not wait for EOF from a pipe someone leaked.
            self.output.drain()
        elif self.output.open:
            # The program is gone but a pipe is still open (without isolation, a daemon may
            # hold it): take what is there shortly, then stop waiting.
            self.loop.call_later(0.5, self._stop_reading)
        self._maybe_done()

    def _stop_reading(self) -> None:
        self.output.drain()
        self._maybe_done()

    def _on_timeout(self) -> None:
        self.timer = None
        if not self.exited:
            used = time.monotonic() - self.started_at
            self.kill(ExecStatus.TIME_LIMIT, self.lim.time_limit_message(used))

    def _maybe_done(self) -> None:
        if self.exited and not self.output.open and not self.done.done():
            self.done.set_result(None)

    def kill(self, reason: ExecStatus, message: str) -> None:
        """SIGKILL the program (its PID namespace follows) and every task left in its cgroup."""
        if self.kill_reason is None:
            self.kill_reason = reason
            self.kill_message = message
        if self.exited:
            return
        if self.step.batch is not None and self.forked is not None:
            self.step.batch.kill(self.forked)
        if self.child_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                if self.ctx.isolated:
                    os.kill(self.child_pid, signal.SIGKILL)
                else:
                    os.killpg(self.child_pid, signal.SIGKILL)
        if self.slot is not None:
            with contextlib.suppress(OSError):
                self.slot.kill_all()
        # bwrap reaps the program and exits by itself; if it has not within the grace, kill it.
        self.loop.call_later(EXIT_GRACE_S, self._kill_bwrap)

    def _kill_bwrap(self) -> None:
        if not self.exited and self.forked is not None:
            self._exited(None)  # the zygote did not report the killed run: give up on it
            self._stop_reading()
        if not self.exited and self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    async def _wait_exit(self, timeout: float) -> None:
        """After a failed start: reap bwrap and keep what it said on stderr."""
        if self.proc is None or self.sandbox is None:
            return
        end = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < end:
            await asyncio.sleep(0.005)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._exited(self.proc.returncode)
        with contextlib.suppress(OSError):
            os.set_blocking(self.sandbox.err_r, False)
            self.output.buffers["stderr"].extend(os.read(self.sandbox.err_r, READ_CHUNK))

    # -------------------------------------------------------------- results

    def _result(self) -> ExecResult:
        stats = self.slot.stats() if self.slot is not None else None
        wall_s = (self.ended_at or time.monotonic()) - self.started_at
        ending = classify(
            self.returncode,
            isolated=self.ctx.isolated,
            killed=(self.kill_reason, self.kill_message) if self.kill_reason else None,
            stats=stats,
            lim=self.lim,
            cpu_time_s=self.cpu_time_s,
            wall_s=wall_s,
        )
        message = ending.message
        if self.over_cap is not None and ending.status == ExecStatus.OUTPUT_LIMIT:
            message = output_limit_message(self.over_cap, self.lim.output_bytes, ending.signal)
        return ExecResult(
            status=ending.status,
            exit_code=ending.exit_code,
            signal=ending.signal,
            stdout=self.output.text("stdout"),
            stderr=self.output.text("stderr"),
            stdout_truncated=self.output.truncated["stdout"],
            stderr_truncated=self.output.truncated["stderr"],
            wall_time_s=round(wall_s, 6),
            cpu_time_s=round(self.cpu_time_s, 6) if self.cpu_time_s is not None else None,
            peak_memory_kb=stats.peak_memory_kb if stats else None,
            message=message,
        )

    def cleanup(self) -> None:
        """Synchronous and idempotent: nothing of this execution survives it, even on cancel."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.exited and self.proc is not None:
            self.kill(self.kill_reason or ExecStatus.ERROR, self.kill_message or "cancelled")
            self.ctx.track(self._reap_later(self.proc))
        elif not self.exited and self.forked is not None:  # the zygote reaps its runner
            self.kill(self.kill_reason or ExecStatus.ERROR, self.kill_message or "cancelled")
        # The caller releases the slot next (drained and removed, or pooled for another run): a
        # zygote's end report arriving after a cancel must not read it (FileNotFoundError in a
        # loop callback, the fork server's top-up skipped) nor kill what another run has in it.
        self.slot = None
        self.output.stop()
        if self.pidfd >= 0 and not self.exited:
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self.pidfd)
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()
        if self.sandbox is not None:
            self.sandbox.close_all()
        if self.pidfd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = -1

    @staticmethod
    async def _reap_later(proc: subprocess.Popen[bytes]) -> None:
        end = time.monotonic() + 10.0
        while proc.poll() is None and time.monotonic() < end:
            await asyncio.sleep(0.01)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
