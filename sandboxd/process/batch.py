"""Service side of a run_tests request on the fork server: one runner (its isolation boundary)
that forks one fresh process per case (see `zygote_cases.py` for what a case gets).

The runner is taken from the fork server like any run's, but is sent the request's run dir with
`"cases": true` and a socket of its own: cases then go to it directly, each with its cgroup's
files and its stdio, and every case is supervised by an `Execution` as a single run is. Closing
the batch (EOF) kills whatever case is left and ends the runner; its slot is released after the
zygote has reaped it. `Batches` opens them: at most one per program in flight, each on a runner of
its own, counted for `/v1/sandbox/status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

from ..languages import Language
from ..models import RunSpec
from ..settings import SandboxSettings
from .bwrap import SANDBOX_UID
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
from .paths import InvalidPath, new_workdir, remove_tree, write_inputs

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
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for returned a reply that came in
            # the loop turn the request was cancelled in, dropping the cancellation (as in
            # toolenv_core.admission), and the cut request's cases would have run on
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                await asyncio.shield(self._ready)
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


class Batches:
    """run_tests requests on a runner of their own: at most `concurrency` at once (each holds a
    runner), with the counts the status shows and why the last one took the per-case path."""

    def __init__(
        self,
        settings: SandboxSettings,
        cgroups: CgroupPool,
        track: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.settings = settings
        self.cgroups = cgroups
        self.track = track  # background work the backend's close() waits for
        self.open = 0  # requests holding a runner of their own
        self.total = 0
        self.fallbacks = 0  # requests that took the per-case path instead
        self.last_fallback = ""

    def status(self) -> dict[str, Any]:
        return {
            "open": self.open,
            "total": self.total,
            "fallbacks": self.fallbacks,
            "last_fallback": self.last_fallback or None,
        }

    @contextlib.asynccontextmanager
    async def batch(
        self, server: ForkServer | None, root: Path, spec: RunSpec, lang: Language
    ) -> AsyncIterator[CaseBatch | None]:
        """The request's batch, or None (`server` None: the language does not fork)."""
        if not (self.settings.fork_server_batch and server is not None):
            yield None
            return
        if self.open >= self.settings.concurrency:
            self._fall_back(f"{self.open} requests hold a runner (the limit)")
            yield None
            return
        self.open += 1  # counted before the await: concurrent requests see it
        batch = None
        try:
            batch = await self._open(server, root, spec, lang)
            if batch is None:
                yield None
                return
            self.total += 1
            yield batch
        finally:
            self.open -= 1
            if batch is not None:  # the answer need not wait for the runner's reaping
                self.track(batch.close())

    def _fall_back(self, reason: str) -> None:
        """Count a request sent to the per-case path, with why (shown in the status)."""
        self.fallbacks += 1
        self.last_fallback = reason

    async def _open(
        self, server: ForkServer, root: Path, spec: RunSpec, lang: Language
    ) -> CaseBatch | None:
        try:
            runner = server.take()
        except ForkFailed as exc:
            self._fall_back(f"no runner: {exc}")
            return None
        if runner.slot is not None:  # the forker's own cgroup: its cases join their own
            runner.slot.configure(
                memory_bytes=self.settings.default_memory_mb << 20,
                pids_max=self.settings.concurrency + 8,
                cpu_cores=None,
            )
        batch = CaseBatch(server, runner, self.cgroups)
        workdir = new_workdir(root)
        try:
            write_inputs(workdir, spec, lang, None if server.userns else SANDBOX_UID)
            await batch.open(workdir.name)
        except (ForkFailed, InvalidPath, OSError) as exc:
            self._fall_back(f"the request's runner did not start: {exc}")
            await batch.close()
            return None
        finally:
            remove_tree(workdir)
        return batch
