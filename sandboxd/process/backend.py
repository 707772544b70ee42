"""The `process` backend's life cycle: every run in a fresh working dir under bubblewrap.

Per step (compile or run) one `bwrap` sandbox (no shell, no helper process) is built and blocked
before exec (`bwrap.spawn_blocked`); the service moves it into the run's pooled cgroup (pids.max,
memory limit and peak, CPU quota when asked), sets its rlimits, then lets it go. Python runs take
a sandbox made ahead of time (`warm.WarmPool`). One `Execution` supervises each step.

Working dirs live under /dev/shm (a tmpfs) by default: the pages a program writes there are
charged to its memory cgroup, so filling "the disk" ends at the run's memory limit, not the
host's disk; the dir is removed after the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from toolenv_core.deadline import Deadline

from ..backend import SandboxUnavailable
from ..languages import (
    DEFAULT_PYTHON,
    Language,
    PythonNotFound,
    UnknownLanguage,
    find_python,
    get_language,
)
from ..models import ExecResult, ExecStatus, Limits, RunResult, RunSpec
from ..settings import SandboxSettings
from . import bwrap
from .batch import Batches, CaseBatch
from .cgroup_slot import CgroupSlot
from .cgroups import CgroupPool
from .execution import ExecContext, Execution, Step
from .forkserver import ForkFailed, ForkServer, Runner
from .limits import StepLimits
from .paths import (
    InvalidPath,
    claim_workdir_root,
    default_workdir_root,
    fetch_files,
    new_workdir,
    remove_lone_source,
    remove_tree,
    remove_workdir,
    stdin_file,
    write_inputs,
)
from .warm import WARM_STDIN_MAX, Warm, WarmPool


def _utf8_len(text: str) -> int:
    """Bytes, not characters: a warm sandbox's stdin pipe holds WARM_STDIN_MAX bytes, and
    40,000 'é' (80,000 bytes) passed a check on characters, filled the pipe before the program
    ran and blocked the event loop: the whole service hung."""
    return len(text) if text.isascii() else len(text.encode())


# A compiler is its PID namespace's init (it reaps every child it starts; the signals an init is
# spared are no compiler's concern): wait4 then has its CPU time, not bwrap's own 2 ms.
COMPILER_AS_INIT = True


class ProcessBackend:
    """Runs programs under bubblewrap with per-run cgroups and rlimits (see module docstring)."""

    name = "process"
    deadline_margin_s = 0.0  # a step's wall limit is what is left of the deadline: killed at it

    def __init__(self, settings: SandboxSettings) -> None:
        self.settings = settings
        self.isolated = not settings.insecure_no_isolation
        self.bwrap: str | None = None
        self.python = DEFAULT_PYTHON  # resolved from the `python` setting at start
        self.root: Path | None = None
        self._root_lock = -1  # the flock that marks `root` this instance's
        self.cgroups = CgroupPool(
            settings.cgroup_pool_size or settings.concurrency * 2,
            cpu_shares=settings.run_cpu_shares,
            in_flight=settings.concurrency,
        )
        self.warm: WarmPool | None = None
        self.fork_server: ForkServer | None = None
        self._ctx: ExecContext | None = None
        self._devnull = -1
        self._ids = itertools.count(1)
        self._running = 0
        self._runs = 0
        self._compiles = 0
        self._started = False
        self._reaping: set[asyncio.Task[None]] = set()
        self._cgroup_writer = ThreadPoolExecutor(1, thread_name_prefix="sandboxd-cgroup")
        self.batches = Batches(settings, self.cgroups, self._track)

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> None:
        s = self.settings
        self.bwrap = s.bwrap_path or shutil.which("bwrap")
        try:
            self.python = find_python(s.python)
        except PythonNotFound as exc:
            raise SandboxUnavailable(str(exc)) from exc
        prefix: list[str] | None = None
        if self.isolated:
            if self.bwrap is None or not os.access(self.bwrap, os.X_OK):
                raise SandboxUnavailable(f"bwrap not found. {bwrap.BWRAP_INSTALL_HINT}")
            prefix = bwrap.sandbox_prefix(self.bwrap, self.python)
            bwrap.probe(prefix)
        root_parent = Path(s.workdir_root) if s.workdir_root else default_workdir_root()
        try:  # a file there, or a place not writable, was a bare OSError naming no setting
            root_parent.mkdir(parents=True, exist_ok=True)
            self.root, self._root_lock = claim_workdir_root(root_parent)
        except OSError as exc:
            raise SandboxUnavailable(
                f"cannot make run directories in {root_parent} ({exc.strerror or exc}); set "
                "TOOLENV_SANDBOX_WORKDIR_ROOT (sandbox.workdir_root) to a writable directory"
            ) from exc
        self.cgroups.start()
        self._devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        if prefix is not None and self.bwrap is not None and s.fork_server:
            prefork = max(1, s.concurrency if s.warm_sandboxes < 0 else s.warm_sandboxes)
            self.fork_server = ForkServer(
                self.bwrap, self.root, self.cgroups, s.fork_server_max_forks, prefork, self.python
            )
            self.fork_server.start()
        self._ctx = ExecContext(prefix, self._cgroup_writer, self._track, self.fork_server)
        self._started = True
        if self.fork_server is not None and self.fork_server.available:
            await self._probe_fork_server(self.fork_server)
        target = s.concurrency if s.warm_sandboxes < 0 else s.warm_sandboxes
        if prefix is not None and target:  # warm sandboxes are bwrap sandboxes
            self.warm = WarmPool(target, prefix, self.root, self.cgroups, self._cgroup_writer)
            for name in s.warm_languages:
                lang = self._language(name)
                if not lang.compiled and not self._forks(lang):
                    self.warm.kick(lang.run_argv, lang.runs_as_init)

    async def _probe_fork_server(self, server: ForkServer) -> None:
        """One real fork before the first request: a kernel that refuses any step of a fork's
        set-up turns the fork server off (python takes the warm-spawn path), with the reason."""
        probe = RunSpec(language="python", code="print('fork-server-ok')")
        result = await self._run_program(probe, Deadline.after(20), counted=False)
        run = result.run
        if run is None or run.exit_code != 0 or run.stdout != "fork-server-ok\n":
            detail = (run.message or run.stderr.strip()) if run is not None else result.message
            code = run.exit_code if run is not None else None
            server.disable(f"the probe fork failed (exit {code}): {detail[-500:]}")

    def _forks(self, lang: Language) -> bool:
        return lang.name == "python" and self.fork_server is not None and self.fork_server.available

    async def close(self) -> None:
        self._started = False
        if self.fork_server is not None:
            self.fork_server.close()
        if self.warm is not None:
            await self.warm.close()
        if self._reaping:
            await asyncio.gather(*self._reaping, return_exceptions=True)
        await self.cgroups.close()
        if self.root is not None:
            remove_tree(self.root)
        if self._root_lock >= 0:
            os.close(self._root_lock)
            self._root_lock = -1
        if self._devnull >= 0:
            os.close(self._devnull)
            self._devnull = -1
        self._cgroup_writer.shutdown(wait=True)

    def status(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "isolation": "bubblewrap" if self.isolated else "none (insecure_no_isolation)",
            "bwrap": self.bwrap,
            "python": self.python,
            "running": self._running,
            "runs_total": self._runs,
            "compiles_total": self._compiles,
            "cgroups": self.cgroups.controllers or self.cgroups.unavailable_reason,
            "cgroups_draining": self.cgroups.draining,
            "cpu_shares": self._cpu_shares(),
            "workdir_root": str(self.root) if self.root else None,
            **self._warm_status(),
            "python_mode": self._python_mode(),
            "run_tests_batches": self.batches.status(),
            "fork_server": self.fork_server.status() if self.fork_server is not None else None,
        }

    def _cpu_shares(self) -> dict[str, int] | None:
        """Each run's CPU weight and all runs' together (None: no cpu cgroup controller)."""
        if "cpu" not in self.cgroups.bases:
            return None
        return {"per_run": self.cgroups.cpu_shares, "all_runs": self.cgroups.group_cpu_shares}

    def _warm_status(self) -> dict[str, Any]:
        status = self.warm.status() if self.warm is not None else WarmPool.off_status()
        if self.fork_server is not None:  # idle zygote processes are expected, like warm ones
            status["warm_pids"] = sorted([*status["warm_pids"], *self.fork_server.idle_pids()])
        return status

    def _python_mode(self) -> str:
        if self._forks(get_language("python")):
            return "fork_server"
        if self.warm is not None and "python" in self.settings.warm_languages:
            return "warm_spawn"
        return "spawn"

    def _language(self, name: str) -> Language:
        """The language table entry, with Python run by the configured interpreter."""
        return get_language(name).with_python(self.python)

    def _track(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run background clean-up that `close()` waits for."""
        task = asyncio.get_running_loop().create_task(work)
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)
        return task

    def _require_started(self) -> tuple[Path, ExecContext]:
        if not self._started or self.root is None or self._ctx is None:
            raise SandboxUnavailable("process backend is not started")
        return self.root, self._ctx

    # ------------------------------------------------------------------ one program

    async def run(self, spec: RunSpec, deadline: Deadline) -> RunResult:
        return await self._run_program(spec, deadline, counted=True)

    async def _run_program(self, spec: RunSpec, deadline: Deadline, *, counted: bool) -> RunResult:
        root, _ = self._require_started()
        try:
            lang = self._language(spec.language)
        except UnknownLanguage as exc:
            return RunResult(message=str(exc), backend=self.name)
        run_id = f"proc-{os.getpid()}-{next(self._ids)}"
        self._runs += counted
        self._running += 1
        warm = runner = None
        if self._forks(lang) and self.fork_server is not None:
            with contextlib.suppress(ForkFailed):  # the zygote is being replaced: spawn instead
                runner = self.fork_server.take()
        if (
            runner is None
            and self.warm is not None
            and lang.name in self.settings.warm_languages
            and not lang.compiled
            and _utf8_len(spec.stdin) <= WARM_STDIN_MAX
        ):
            warm = self.warm.take(lang.run_argv, lang.runs_as_init)
        if warm is not None:
            workdir, slot = warm.workdir, warm.slot
        elif runner is not None:
            workdir, slot = new_workdir(root), runner.slot
        else:
            workdir, slot = new_workdir(root), self.cgroups.acquire()
        try:
            return await self._run_in(spec, lang, workdir, slot, deadline, run_id, warm, runner)
        finally:
            self._running -= 1
            if runner is not None and not runner.used and self.fork_server is not None:
                remove_workdir(workdir, lang.source_file)
                self.fork_server.give_back(runner)  # never used: it waits for the next run
            elif warm is not None and not warm.used and self.warm is not None:
                warm.sandbox.kill_child()  # never started: kill it, reap in the background
                self._track(self.warm.dispose_later(warm))
            elif remove_lone_source(workdir, lang.source_file):
                if slot is not None:
                    self.cgroups.release(slot)
            else:
                # the answer (and the run's admission) waits, the event loop does not; a caller
                # gone meanwhile leaves it to finish in the background
                await asyncio.shield(self._track(self._free_later(workdir, slot)))

    async def _free_later(self, workdir: Path, slot: CgroupSlot | None) -> None:
        """A run dir the program filled, removed on a thread: the event loop took seconds to
        remove 2 million empty files, and answered no one meanwhile. Its slot is released
        after (the files' pages are charged to the slot's memory cgroup)."""
        await asyncio.to_thread(remove_tree, workdir)
        if slot is not None:
            self.cgroups.release(slot)

    async def _run_in(
        self,
        spec: RunSpec,
        lang: Language,
        workdir: Path,
        slot: CgroupSlot | None,
        deadline: Deadline,
        run_id: str,
        warm: Warm | None = None,
        runner: Runner | None = None,
    ) -> RunResult:
        result = RunResult(sandbox_id=run_id, backend=self.name)
        # a fork-server run outside a user namespace is uid 65534 itself: its files are made its
        server = self.fork_server
        owner = bwrap.SANDBOX_UID if runner and server and not server.userns else None
        try:
            write_inputs(workdir, spec, lang, owner)
            if spec.prebuilt is not None and lang.artifact is not None:
                artifact = workdir / lang.artifact
                artifact.write_bytes(spec.prebuilt)
                artifact.chmod(0o755)
        except (InvalidPath, OSError) as exc:
            result.message = f"could not prepare the working dir: {exc}"
            return result
        compiled = True
        if spec.prebuilt is None and lang.compile_argv is not None:
            self._compiles += 1
            result.compile = await self._exec(
                lang.compile_argv, workdir, spec.compile_limits, b"", deadline, slot,
                as_init=COMPILER_AS_INIT,
            )  # fmt: skip
            compiled = (
                result.compile.status == ExecStatus.FINISHED and result.compile.exit_code == 0
            )
            if not compiled:
                result.message = result.compile.compile_failure()
            elif slot is not None:
                slot.reset()
        if compiled:
            result.run = await self._exec(
                lang.run_argv,
                workdir,
                spec.run_limits,
                spec.stdin.encode(),
                deadline,
                slot,
                warm,
                runner,
                as_init=lang.runs_as_init,
            )
        # after a failed compile too, as the Docker agent and SandboxFusion fetch them (it
        # answered `files: {}` here, the request's own input files left out)
        cap = spec.run_limits.max_output_bytes or self.settings.max_output_bytes
        result.files = fetch_files(workdir, spec.fetch_files, cap)
        return result

    def case_batch(
        self, spec: RunSpec, deadline: Deadline
    ) -> AbstractAsyncContextManager[CaseBatch | None]:
        """For run_tests: one fork-server runner for every case of the request (None: cases take
        the per-case path: not python, no fork server, or as many batches open as programs)."""
        root, _ = self._require_started()
        lang = self._language(spec.language)
        server = self.fork_server if self._forks(lang) else None
        return self.batches.batch(server, root, spec, lang)

    async def run_case(self, batch: CaseBatch, spec: RunSpec, deadline: Deadline) -> RunResult:
        """One case of a batch: a fresh process forked by the request's runner, in its own
        cgroup slot, supervised and classified as a single run is."""
        if not batch.alive:
            return await self.run(spec, deadline)  # the forker is gone: the per-case path
        root, _ = self._require_started()
        lang = self._language(spec.language)
        result = RunResult(sandbox_id=f"proc-{os.getpid()}-{next(self._ids)}", backend=self.name)
        slot = self.cgroups.acquire()
        self._runs += 1
        self._running += 1
        try:
            result.run = await self._exec(
                lang.run_argv, root, spec.run_limits, spec.stdin.encode(), deadline, slot,
                batch=batch,
            )  # fmt: skip
            return result
        finally:
            self._running -= 1
            if slot is not None:
                self.cgroups.release(slot)

    async def compile(self, spec: RunSpec, deadline: Deadline) -> tuple[ExecResult, bytes | None]:
        """Compile once (for many runs of the same program): the result and the artifact."""
        root, _ = self._require_started()
        lang = self._language(spec.language)
        if lang.compile_argv is None or lang.artifact is None:
            raise ValueError(f"{lang.name} has no compile step")
        workdir = new_workdir(root)
        slot = self.cgroups.acquire()
        self._running += 1
        self._compiles += 1
        try:
            write_inputs(workdir, spec, lang)
            result = await self._exec(
                lang.compile_argv, workdir, spec.compile_limits, b"", deadline, slot,
                as_init=COMPILER_AS_INIT,
            )  # fmt: skip
            artifact = None
            if result.status == ExecStatus.FINISHED and result.exit_code == 0:
                cap = self.settings.max_output_bytes
                artifact = fetch_files(workdir, [lang.artifact], cap).get(lang.artifact)
            return result, artifact
        finally:
            self._running -= 1
            remove_tree(workdir)
            if slot is not None:
                self.cgroups.release(slot)

    async def _exec(
        self,
        argv: tuple[str, ...],
        workdir: Path,
        limits: Limits,
        stdin: bytes,
        deadline: Deadline,
        slot: CgroupSlot | None,
        warm: Warm | None = None,
        runner: Runner | None = None,
        batch: CaseBatch | None = None,
        as_init: bool = False,
    ) -> ExecResult:
        root, ctx = self._require_started()
        lim = StepLimits.resolve(self.settings, limits, deadline)
        if lim.wall_s <= 0:
            return ExecResult.expired_before_start()
        if slot is not None:
            # a spawned program that is not its namespace's init has bwrap's init beside it in
            # the slot: one task more, so that the program keeps its max_processes
            spawned_init = ctx.isolated and not (as_init or runner or batch)
            pids = lim.pids + 1 if spawned_init else lim.pids
            try:
                slot.configure(
                    memory_bytes=lim.memory_bytes, pids_max=pids, cpu_cores=lim.cpu_cores
                )
            except OSError as exc:
                return ExecResult(status=ExecStatus.ERROR, message=f"cgroup set-up failed: {exc}")
        own_stdin = None if warm is not None or not stdin else stdin_file(stdin)
        stdin_fd = self._devnull if own_stdin is None else own_stdin
        step = Step(argv, workdir, lim, slot, stdin_fd, stdin, warm, runner, batch, as_init)
        execution = Execution(ctx, step)
        try:
            return await execution.run()
        finally:
            # only the fd opened here: after close() reset `_devnull` to -1, a comparison with it
            # closed the shared /dev/null's old number, by then perhaps another file's
            if own_stdin is not None:
                os.close(own_stdin)
            execution.cleanup()
