"""Service side of a run_tests request on the fork server: one runner (its isolation boundary)
that forks one fresh process per case (see `zygote_cases.py` for what a case gets).

The runner is taken from the fork server like any run's, but is sent the request's run dir with
`"cases": true` and a socket of its own: cases then go to it directly, each with its cgroup's
files and its stdio, and every case is supervised by an `Execution` as a single run is. Closing
the batch (EOF) kills whatever case is left and ends the runner; its slot is released after the
zygote has reaped it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
from typing import Any

from .cgroup_slot import CgroupSlot
from .cgroups import CgroupPool
from .forkserver import (
    REPLY_TIMEOUT_S,
    ForkedRun,
    ForkFailed,
    ForkServer,
    Runner,
    read_messages,
)

CLOSE_TIMEOUT_S = 5.0


class CaseBatch:
    """One request's runner in run_tests mode, and the cases in flight on it."""

    def __init__(self, server: ForkServer, runner: Runner, cgroups: CgroupPool) -> None:
        self.server = server
        self.runner = runner
        self.cgroups = cgroups
        self.ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ours.setblocking(False)
        self.alive = False
        self.reason = ""
        self.forked: ForkedRun | None = None
        self.cases: dict[int, ForkedRun] = {}
        self._ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._ids = itertools.count(1)
        self._loop = asyncio.get_running_loop()

    async def open(self, workdir_name: str) -> None:
        """Hand the runner its request (the files are read from `workdir_name` before this
        returns, so the dir can go); raises ForkFailed."""
        request = {"workdir": workdir_name, "cases": True, "rlimits": []}
        try:
            self.forked = await self.server.fork(self.runner, request, [self.theirs.fileno()])
        finally:
            self.theirs.close()
        self._loop.add_reader(self.ours.fileno(), self._on_message)
        self.forked.ended.add_done_callback(lambda _: self._fail("the case forker exited"))
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), REPLY_TIMEOUT_S)
        except (TimeoutError, ForkFailed) as exc:
            self._fail(f"the case forker did not start: {exc or type(exc).__name__}")
            raise ForkFailed(self.reason) from exc
        self.alive = True

    async def fork(
        self, request: dict[str, Any], fds: list[int], slot: CgroupSlot | None
    ) -> ForkedRun:
        """Start one case (as `ForkServer.fork`): `fds` are its stdin, stdout and stderr; the
        files of `slot` (the case's cgroup) are added here. Returns once the request is sent:
        the case's pid is the forker's business (cases are killed through `kill` and their
        cgroup), so no answer is awaited; a failed clone ends the run with an error."""
        if not self.alive:
            raise ForkFailed(self.reason or "the case forker is gone")
        case_id = next(self._ids)
        run = ForkedRun(case_id)
        cg_fds = slot.join_fds() if slot is not None else []
        self.cases[case_id] = run
        try:
            payload = json.dumps({"case": case_id, "cgroups": len(cg_fds), **request}).encode()
            socket.send_fds(self.ours, [payload], [*cg_fds, *fds])
        except OSError as exc:
            self.cases.pop(case_id, None)
            self._fail(f"the case forker did not take a case: {exc}")
            raise ForkFailed(self.reason) from exc
        finally:
            if slot is not None:
                slot.done_join_fds(cg_fds)
        return run

    def kill(self, run: ForkedRun) -> None:
        """SIGKILL one case (the forker knows its pid; its PID namespace follows)."""
        if self.alive and not run.ended.done():
            with contextlib.suppress(OSError):
                self.ours.send(json.dumps({"kill": run.run_id}).encode())

    def _on_message(self) -> None:
        read_messages(self.ours, self._handle, lambda: self._fail("the case forker exited"))

    def _handle(self, msg: dict[str, Any]) -> None:
        if "ready" in msg:
            if not self._ready.done():
                self._ready.set_result(int(msg["ready"]))
            return
        run = self.cases.pop(msg.get("case"), None)
        if run is None or run.ended.done():
            return
        if "error" in msg:
            run.ended.set_result(str(msg["error"]))
        else:
            run.ended.set_result((int(msg["status"]), float(msg["cpu"])))

    def _fail(self, why: str) -> None:
        self.alive = False
        self.reason = self.reason or why
        if not self._ready.done():
            self._ready.set_exception(ForkFailed(why))
            self._ready.exception()  # retrieved: nobody may be waiting any more
        for run in self.cases.values():
            if not run.ended.done():
                run.ended.set_result(why)
        self.cases.clear()
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self.ours.fileno())

    async def close(self) -> None:
        """EOF to the forker (it kills any case left and exits); wait for the zygote to reap
        it, else kill it; then release its slot."""
        self._fail("the request is over")
        self.ours.close()
        forked = self.forked
        if forked is not None and not forked.ended.done():
            try:
                await asyncio.wait_for(asyncio.shield(forked.ended), CLOSE_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(forked.pid, signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(forked.ended), CLOSE_TIMEOUT_S)
        if self.runner.slot is not None:
            self.cgroups.release(self.runner.slot)
        self.server.run_ended()
