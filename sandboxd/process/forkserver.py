"""The python fork server, service side: one zygote at a time, replaced after N forks or at once
on any anomaly; a run asks it for one fork (see `zygote_main.py` for what a fork does).

A python run through the fork server skips the interpreter's start-up (the zygote did it once):
the request, the fork and the namespace set-up are the critical path. When the zygote cannot be
started (no CAP_SYS_ADMIN, no namespaces), `available` is False with a reason and python runs
take the warm-spawn path instead; the mode is in `/v1/sandbox/status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cgroup_slot import CgroupSlot
from .cgroups import CgroupPool
from .forkserver_argv import needs_user_namespace, zygote_argv

START_TIMEOUT_S = 10.0
REPLY_TIMEOUT_S = 5.0


class ForkFailed(RuntimeError):
    """The zygote could not run this request (it is being replaced)."""


@dataclass
class Runner:
    """A runner forked ahead of time, its program waiting in `slot`'s cgroup for a request."""

    zygote: Zygote
    key: int
    slot: CgroupSlot | None
    pid: int = 0
    used: bool = False  # a run was sent to it (else it goes back to the idle pool)


@dataclass
class ForkedRun:
    """One run forked by a zygote: the runner's pid, then how it ended."""

    run_id: int
    pid: int = 0
    # (exit status as bwrap reports it, CPU seconds) or an error message
    ended: asyncio.Future[tuple[int, float] | str] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


class Zygote:
    """One zygote process, the control socket to it, and its idle runners."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.proc = proc
        self.sock = sock
        self.forks = 0
        self.completed = 0  # runs that ended with a status (not an error)
        self.alive = True
        self.anomaly = ""
        self.on_failure: Callable[[Zygote], None] | None = None  # told once, when it fails
        self.failure_counted = False
        self.idle: dict[int, Runner] = {}
        self.runs: dict[int, ForkedRun] = {}
        self._pids: dict[int, asyncio.Future[int]] = {}  # runs whose pid is awaited
        self._unanswered: dict[int, asyncio.TimerHandle] = {}  # runs not yet answered
        self._loop = asyncio.get_running_loop()
        sock.setblocking(False)
        self._loop.add_reader(sock.fileno(), self._on_message)

    @classmethod
    def start(cls, argv: list[str]) -> Zygote:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = subprocess.Popen(
                argv,
                stdin=theirs.fileno(),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={},
                close_fds=True,
                # Its own session: a terminal's Ctrl-C (SIGINT to the foreground process group)
                # must drain the service, not kill the zygote under runs in flight.
                start_new_session=True,
            )
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        return cls(proc, ours)

    @property
    def in_flight(self) -> int:
        return len(self.runs)

    def spawn(self, key: int, slot: CgroupSlot | None) -> Runner:
        """Ask for one more runner; its program joins `slot` (every controller) ahead of time."""
        runner = Runner(self, key, slot)
        fds = slot.join_fds() if slot is not None else []
        try:  # the cgroup files go as fds: the zygote sees no cgroup file system
            socket.send_fds(self.sock, [b'{"spawn": %d}' % key], fds)
        finally:
            if slot is not None:
                slot.done_join_fds(fds)
        self.idle[key] = runner
        return runner

    async def fork(
        self, runner: Runner, run_id: int, request: dict[str, Any], fds: list[int]
    ) -> ForkedRun:
        """Hand one run to `runner`. Returns once the request is sent when the runner's pid is
        known (from its "spawned" answer: the common case; the zygote's answer to a run names
        the same pid), else once the zygote has answered with it. An answer that is not
        awaited is still watched for: none within `REPLY_TIMEOUT_S` fails the zygote and its
        runs, as an awaited one would (one event-loop wake-up less per run)."""
        if not self.alive:
            raise ForkFailed(self.anomaly or "the zygote is gone")
        run = ForkedRun(run_id, runner.pid)
        self.runs[run_id] = run
        self.forks += 1
        pid_reply: asyncio.Future[int] | None = None
        if not runner.pid:
            pid_reply = self._pids[run_id] = self._loop.create_future()
        self._unanswered[run_id] = self._loop.call_later(REPLY_TIMEOUT_S, self._overdue, run_id)
        try:
            payload = json.dumps({"id": run_id, "runner": runner.key, **request}).encode()
            socket.send_fds(self.sock, [payload], fds)
            if pid_reply is not None:
                run.pid = await self._pid_of(pid_reply)
        except OSError as exc:
            self.runs.pop(run_id, None)
            self._fail(f"the zygote did not answer: {exc}")
            raise ForkFailed(str(exc) or "the zygote did not answer") from exc
        finally:
            self._pids.pop(run_id, None)
        return run

    @staticmethod
    async def _pid_of(reply: asyncio.Future[int]) -> int:
        """The runner's pid. A caller gone meanwhile (a hang-up) leaves a runner that has the
        request, and its run dir goes next: its set-up failed there, read as an anomaly that
        replaced the zygote. So the pid is still awaited (a moment) and the runner killed."""
        try:
            return await asyncio.shield(reply)
        except asyncio.CancelledError:
            with contextlib.suppress(ForkFailed, ProcessLookupError):
                os.kill(await reply, signal.SIGKILL)
            raise

    def _overdue(self, run_id: int) -> None:
        if self._unanswered.pop(run_id, None) is not None:
            self._fail(f"the zygote did not answer within {REPLY_TIMEOUT_S} s")

    def _answered(self, run_id: Any) -> None:
        timer = self._unanswered.pop(run_id, None)
        if timer is not None:
            timer.cancel()

    def _on_message(self) -> None:
        read_messages(self.sock, self._handle, lambda: self._fail("the zygote exited"))

    def _handle(self, msg: dict[str, Any]) -> None:
        if "spawned" in msg:
            runner = self.idle.get(msg["spawned"])
            if runner is not None:
                runner.pid = int(msg["pid"])
            return
        if "anomaly" in msg:
            self.alive = False
            self.anomaly = str(msg["anomaly"])
            self._tell_failure()
            return
        run_id = msg.get("id")
        self._answered(run_id)
        if "pid" in msg:
            waiter = self._pids.get(run_id)
            if waiter is not None and not waiter.done():
                waiter.set_result(int(msg["pid"]))
            return
        run = self.runs.pop(run_id, None)
        if run is None or run.ended.done():
            return
        if "error" in msg:
            run.ended.set_result(str(msg["error"]))
            self.alive = False  # an anomaly: no more runs on this zygote
            self.anomaly = str(msg["error"])
            self._tell_failure()
        else:
            self.completed += 1
            run.ended.set_result((int(msg["status"]), float(msg["cpu"])))

    def idle_pids(self) -> list[int]:
        """The zygote's processes that are not a run: bwrap, the zygote, the idle runners and
        the programs waiting under them (for operators and leak checks)."""
        if not self.alive:
            return []
        pids = [self.proc.pid, *_children(self.proc.pid)]
        for runner in self.idle.values():
            if runner.pid:
                pids += [runner.pid, *_children(runner.pid)]
        return pids

    def _tell_failure(self) -> None:  # once, after the message that showed it
        if self.on_failure is not None:
            self._loop.call_soon(self.on_failure, self)
            self.on_failure = None

    def _fail(self, why: str) -> None:
        self.alive = False
        self.anomaly = self.anomaly or why
        self._tell_failure()
        for waiter in self._pids.values():
            if not waiter.done():
                waiter.set_exception(ForkFailed(why))
        self._forget_unanswered()
        for run in self.runs.values():
            if not run.ended.done():
                run.ended.set_result(why)
        self.runs.clear()
        self._stop_reading()

    def _forget_unanswered(self) -> None:
        """No answer is watched for any more (the zygote failed or is closing)."""
        for timer in self._unanswered.values():
            timer.cancel()
        self._unanswered.clear()

    def _stop_reading(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self.sock.fileno())

    def close(self) -> list[CgroupSlot]:
        """EOF to the zygote: it kills whatever it still runs and exits; reap it. Returns the
        idle runners' slots (their tasks are dead or dying) for the caller to release."""
        self.alive = False
        self._forget_unanswered()
        self._stop_reading()
        self.sock.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        slots = [r.slot for r in self.idle.values() if r.slot is not None]
        self.idle.clear()
        return slots


def read_messages(
    sock: socket.socket,
    handle: Callable[[dict[str, Any]], None],
    on_eof: Callable[[], None],
) -> None:
    """Every JSON datagram waiting on a non-blocking control socket, in order; `on_eof` once the
    other end is gone (its process exited)."""
    while True:
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            on_eof()
            return
        handle(json.loads(data))


class ForkServer:
    """Keeps one healthy zygote with `prefork` idle runners; replaces the zygote after
    `max_forks` runs or on any anomaly."""

    def __init__(
        self,
        bwrap: str,
        root: Path,
        cgroups: CgroupPool,
        max_forks: int,
        prefork: int,
        python: str,
    ) -> None:
        self.userns = needs_user_namespace()
        self.argv = zygote_argv(bwrap, root, python, self.userns)
        self.cgroups = cgroups
        self.max_forks = max_forks
        self.prefork = prefork
        self.current: Zygote | None = None
        self.available = False
        self.reason = "not started"
        self.started_total = 0
        self.anomalies = 0
        self.last_anomaly = ""
        self._ids = itertools.count(1)
        self._retired: list[Zygote] = []

    def start(self) -> None:
        try:
            self._replace()
            self.available = True
            self.reason = ""
        except OSError as exc:
            self.reason = f"the zygote could not start: {exc}"

    def disable(self, reason: str) -> None:
        """The probe failed: python runs take the warm-spawn path."""
        self.available = False
        self.reason = reason
        self.close()

    def _replace(self) -> None:
        old = self.current
        self.current = Zygote.start(self.argv)
        self.current.on_failure = self._on_failure
        self.started_total += 1
        if old is not None:
            self._retired.append(old)
        self._close_idle_retired()
        with contextlib.suppress(ForkFailed):
            self._top_up(self.current)

    def _top_up(self, z: Zygote) -> None:
        while len(z.idle) < self.prefork and z.alive:
            self._spawn(z)

    def _spawn(self, z: Zygote) -> Runner:
        slot = self.cgroups.acquire()
        try:
            return z.spawn(next(self._ids), slot)
        except OSError as exc:  # the zygote is gone: the next take replaces it
            if slot is not None:
                self.cgroups.release(slot)
            z.alive = False
            z.anomaly = z.anomaly or f"the zygote did not take a spawn: {exc}"
            raise ForkFailed(z.anomaly) from exc

    def _close_idle_retired(self) -> None:
        for z in [z for z in self._retired if z.in_flight == 0]:
            self._retired.remove(z)
            self._release(z.close())

    def _release(self, slots: list[CgroupSlot]) -> None:
        for slot in slots:
            self.cgroups.release(slot)

    def take(self) -> Runner:
        """An idle runner of a healthy zygote (spawned now if none is idle); raises ForkFailed."""
        z = self.current
        if z is None or not self.available:
            raise ForkFailed(self.reason or "the fork server is off")
        if not z.alive or z.forks >= self.max_forks:
            if not z.alive:
                self._count_anomaly(z)
            try:
                self._replace()
            except OSError as exc:
                raise ForkFailed(f"a new zygote could not start: {exc}") from exc
            z = self.current
            assert z is not None
        if z.idle:
            runner = z.idle.pop(next(iter(z.idle)))
        else:
            runner = self._spawn(z)
            z.idle.pop(runner.key)
        return runner

    def _count_anomaly(self, z: Zygote) -> None:
        if not z.failure_counted:
            z.failure_counted = True
            self.anomalies += 1
            self.last_anomaly = z.anomaly or "the zygote failed"

    def _on_failure(self, z: Zygote) -> None:
        """A failed zygote is counted and replaced now, not by the next python run (until then
        the status showed no anomaly, and the zombie and its runners' slots stayed). One that
        never ran a program (the start-up probe's) is left to the next run: no restart loop."""
        self._count_anomaly(z)
        if z is self.current and self.available and z.completed > 0:
            with contextlib.suppress(OSError):
                self._replace()

    async def fork(self, runner: Runner, request: dict[str, Any], fds: list[int]) -> ForkedRun:
        """Hand the run to its runner. The zygote serves its messages in order, so a spawn sent
        first (a clone into fresh namespaces, ~1 ms) would sit on the run's critical path; and
        a spawn sent while the run starts competes with it for the CPU. So the idle runners
        are topped up now only when fewer than half are left, else when a run ends."""
        runner.used = True
        try:
            return await runner.zygote.fork(runner, next(self._ids), request, fds)
        finally:
            if len(runner.zygote.idle) < self.prefork / 2:
                self.top_up()

    def top_up(self) -> None:
        """Bring the current zygote back to `prefork` idle runners (if it is healthy)."""
        z = self.current
        if z is not None and z.alive and self.available:
            with contextlib.suppress(ForkFailed):
                self._top_up(z)

    def give_back(self, runner: Runner) -> None:
        """A runner taken for a run that never started: idle again (or freed with its zygote)."""
        if runner.zygote.alive and runner.zygote is self.current:
            runner.zygote.idle[runner.key] = runner
        elif runner.slot is not None:
            self.cgroups.release(runner.slot)
        self.top_up()

    def run_ended(self) -> None:
        """A run's result is in: retired zygotes with nothing in flight can go, and the idle
        runners are topped up."""
        if self._retired:
            self._close_idle_retired()
        self.top_up()

    def status(self) -> dict[str, Any]:
        z = self.current
        return {
            "available": self.available,
            "reason": self.reason or None,
            "zygote_pid": z.proc.pid if z is not None and z.alive else None,
            "forks": z.forks if z is not None else 0,
            "idle_runners": len(z.idle) if z is not None else 0,
            "max_forks": self.max_forks,
            "prefork": self.prefork,
            "user_namespace": self.userns,
            "zygotes_started": self.started_total,
            "anomalies": self.anomalies,
            "last_anomaly": self.last_anomaly or None,
        }

    def idle_pids(self) -> list[int]:
        zygotes = [*self._retired, *([self.current] if self.current else [])]
        return [pid for z in zygotes for pid in z.idle_pids()]

    def close(self) -> None:
        for z in [*self._retired, *([self.current] if self.current else [])]:
            self._release(z.close())
        self._retired.clear()
        self.current = None
