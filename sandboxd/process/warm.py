"""Warm sandboxes: bwrap sandboxes built ahead of time, blocked before the program's exec.

For the languages in `warm_languages` (python by default) up to `warm_sandboxes` sandboxes per
language wait with a fresh empty working dir bound, their namespaces built and their cgroup
joined (pids, memory, cpu). A run writes its files into that dir, its stdin into the pipe, sets the
limits and unblocks one (a refill starts at once), so the critical path is the interpreter's own
start, not bwrap's set-up. A warm sandbox is used once; nothing runs in it before the request's
code. It is made by the same `spawn_blocked` handshake as a cold run.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .bwrap import Blocked, spawn_blocked
from .cgroup_slot import CgroupSlot
from .cgroups import CgroupPool
from .paths import new_workdir, remove_tree

WARM_STDIN_MAX = 65536  # a warm sandbox's stdin is a pipe written in one go: at most its buffer


@dataclass
class Warm:
    """One sandbox made ahead of time for `argv`."""

    argv: tuple[str, ...]
    sandbox: Blocked
    workdir: Path
    slot: CgroupSlot | None
    used: bool = False  # its program was started (else the taker kills and disposes of it)


class WarmPool:
    """Keeps `target` blocked sandboxes per argv; refills in the background after each take."""

    def __init__(
        self, target: int, prefix: list[str], root: Path, cgroups: CgroupPool, writer: Executor
    ) -> None:
        self.target = target
        self.prefix = prefix
        self.root = root
        self.cgroups = cgroups
        self.writer = writer
        self.hits = 0
        self._open = True
        self._idle: dict[tuple[str, ...], list[Warm]] = {}
        self._fillers: dict[tuple[str, ...], asyncio.Task[None]] = {}

    def kick(self, key: tuple[str, ...], as_init: bool) -> None:
        """Fill the pool of `key` (a language's run argv; `as_init`: see `bwrap.spawn_blocked`)."""
        if self._open and self.target and key not in self._fillers:
            fill = self._fill(key, as_init)
            self._fillers[key] = asyncio.get_running_loop().create_task(fill)

    def take(self, key: tuple[str, ...], as_init: bool) -> Warm | None:
        pool = self._idle.get(key)
        w = pool.pop() if pool else None
        self.kick(key, as_init)
        if w is not None:
            self.hits += 1
        return w

    async def _fill(self, key: tuple[str, ...], as_init: bool) -> None:
        failures = 0
        try:
            while self._open and len(self._idle.setdefault(key, [])) < self.target:
                w = await self._spawn(key, as_init)
                if w is None:
                    failures += 1
                    if failures >= 5:
                        return  # the cold path still works; do not spin
                    await asyncio.sleep(0.2 * failures)
                    continue
                if not self._open:
                    w.sandbox.kill_child()
                    self.dispose(w)
                    return
                self._idle[key].append(w)
        finally:
            self._fillers.pop(key, None)

    async def _spawn(self, argv: tuple[str, ...], as_init: bool) -> Warm | None:
        workdir = new_workdir(self.root)
        slot = self.cgroups.acquire()
        try:
            sandbox = await spawn_blocked(self.prefix, workdir, argv, None, as_init)
        except OSError:
            self._free(workdir, slot)
            return None
        except asyncio.CancelledError:
            self._free(workdir, slot)
            raise
        w = Warm(argv, sandbox, workdir, slot)
        try:
            if sandbox.child_pid is None:
                raise OSError("bwrap did not start the sandbox")
            if slot is not None:
                await asyncio.get_running_loop().run_in_executor(
                    self.writer, slot.attach, sandbox.child_pid
                )
            return w
        except (OSError, asyncio.CancelledError) as exc:
            sandbox.kill_child()
            sandbox.proc.kill()
            self.dispose(w)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return None

    def _free(self, workdir: Path, slot: CgroupSlot | None) -> None:
        remove_tree(workdir)
        if slot is not None:
            self.cgroups.release(slot)

    def dispose(self, w: Warm) -> None:
        """Free a killed warm sandbox: reap bwrap, close fds, drop its dir and slot."""
        try:
            w.sandbox.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            w.sandbox.proc.kill()
            w.sandbox.proc.wait()
        w.sandbox.close_all()
        self._free(w.workdir, w.slot)

    async def dispose_later(self, w: Warm) -> None:
        """For a taken sandbox whose run never started: wait for bwrap off the loop, then free."""
        end = time.monotonic() + 10
        while w.sandbox.proc.poll() is None and time.monotonic() < end:
            await asyncio.sleep(0.01)
        self.dispose(w)

    async def close(self) -> None:
        self._open = False
        for task in list(self._fillers.values()):
            task.cancel()
        await asyncio.gather(*self._fillers.values(), return_exceptions=True)
        idle = [w for ws in self._idle.values() for w in ws]
        self._idle.clear()
        for w in idle:
            w.sandbox.kill_child()
        for w in idle:
            self.dispose(w)

    @staticmethod
    def off_status() -> dict[str, Any]:
        return {"warm": {}, "warm_target": 0, "warm_hits": 0, "warm_pids": [], "warm_workdirs": []}

    def status(self) -> dict[str, Any]:
        idle = [w for ws in self._idle.values() for w in ws]
        return {
            "warm": {" ".join(k): len(v) for k, v in self._idle.items()},
            "warm_target": self.target,
            "warm_hits": self.hits,
            # what the idle warm sandboxes hold (so operators and leak checks can tell them apart)
            "warm_pids": sorted(
                pid for w in idle for pid in (w.sandbox.proc.pid, w.sandbox.child_pid) if pid
            ),
            "warm_workdirs": sorted(w.workdir.name for w in idle),
        }
