"""The `process` backend: every run in a fresh temp working dir under bubblewrap.

Per step (compile or run) the service spawns one `bwrap` (no shell, no helper process):

    bwrap --unshare-all --as-pid-1 --die-with-parent ... --block-fd B --json-status-fd S -- ARGV

bwrap reports the sandboxed child's pid on S and then waits on B, so before any user code runs
the service moves that child into the run's pooled cgroup (pids.max, memory limit and peak, CPU
quota when asked) and sets its rlimits with prlimit(2); then it writes one byte to B.

Warm sandboxes: for the languages in `warm_languages` (python by default) that handshake is done
ahead of time. Up to `warm_sandboxes` bwraps per language wait, blocked, with a fresh empty
working dir bound, their namespaces built and their cgroup joined; a run writes its files into
that dir, its stdin into the pipe, sets the limits, and unblocks one (a refill starts at once).
So the critical path is the interpreter's own start, not bwrap's set-up. A warm sandbox is used
once; nothing runs in it before the request's code. With `--as-pid-1`
the program is the init of its own PID namespace: when it exits or is killed, the kernel kills
and reaps everything else in the namespace (so a setsid + double-fork daemon dies with it), and
bwrap itself reaps the program, so no zombie is left for anybody. A deadline, an output flood or
a cancelled request SIGKILLs the program (the namespace follows) and, as a backstop, every task
still in the run's cgroup. stdout and stderr are read on the event loop (no thread per run) up to
`max_output_bytes` each; a program that writes more is killed at once (`OutputLimitExceeded`),
so a 1 GB flood costs a few milliseconds and a bounded buffer.

Working dirs live under /dev/shm (a tmpfs) by default: the pages a program writes there are
charged to its memory cgroup, so filling "the disk" ends at the run's memory limit, not the
host's disk; the dir is removed after the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolenv_core.deadline import Deadline

from .backend import SandboxUnavailable
from .cgroups import PREFIX, CgroupPool, CgroupSlot, CgroupStats
from .languages import Language, UnknownLanguage, get_language
from .models import ExecResult, ExecStatus, Limits, RunResult, RunSpec
from .settings import SandboxSettings

BWRAP_INSTALL_HINT = (
    "bubblewrap (bwrap) is required by the process backend for isolation: install it with "
    "`apt-get install bubblewrap` (Debian/Ubuntu) or `dnf install bubblewrap` (Fedora), or run "
    "`make run`, which installs it. To run programs WITHOUT any isolation (trusted code only), "
    "pass --insecure-no-isolation or set TOOLENV_SANDBOX_INSECURE_NO_ISOLATION=1."
)
SANDBOX_DIR = "/sandbox"  # where the run's working dir appears inside the sandbox
SANDBOX_UID = 65534
CHILD_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONUNBUFFERED": "1",  # partial output survives a kill at the time limit
}
READ_CHUNK = 65536
HANDSHAKE_TIMEOUT_S = 10.0
EXIT_GRACE_S = 2.0
WARM_STDIN_MAX = 65536  # a warm sandbox's stdin is a pipe written in one go: at most its buffer  # after a kill: how long bwrap may take to report before it is killed too


class InvalidPath(ValueError):
    """A file name in `files` / `fetch_files` that would leave the working dir."""


def safe_relative_path(name: str) -> Path:
    """A workdir-relative path with no `..`, no absolute part, no NUL; else `InvalidPath`."""
    p = Path(name)
    if not name or "\0" in name or p.is_absolute() or ".." in p.parts or name.strip() in (".", ""):
        raise InvalidPath(f"file path {name!r} must be relative to the working dir, without '..'")
    return p


def _default_workdir_root() -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


def _system_binds() -> list[str]:
    """Read-only /usr plus the /lib, /lib64, /bin, /sbin links (or dirs) of the host."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("lib", "lib64", "lib32", "bin", "sbin"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    for etc in ("/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime"):
        args += ["--ro-bind-try", etc, etc]
    return args


@dataclass
class _StepLimits:
    wall_s: float
    cpu_s: int
    memory_bytes: int | None
    pids: int | None
    nofile: int
    fsize_bytes: int
    output_bytes: int
    cpu_cores: float | None


@dataclass
class _Warm:
    """A sandbox spawned ahead of time: namespaces built, cgroup joined, blocked before exec."""

    argv: tuple[str, ...]
    proc: subprocess.Popen[bytes]
    child_pid: int
    workdir: Path
    slot: CgroupSlot | None
    stdin_w: int
    out_r: int
    err_r: int
    blk_w: int
    st_r: int
    used: bool = False

    def parent_fds(self) -> list[int]:
        return [self.out_r, self.err_r, self.blk_w, self.st_r]


async def _read_child_pid(fd: int, timeout: float = HANDSHAKE_TIMEOUT_S) -> int | None:
    """bwrap's first JSON status document names the sandboxed child's pid."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int | None] = loop.create_future()
    buf = bytearray()

    def on_readable() -> None:
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            fut.done() or fut.set_result(None)
            return
        buf.extend(chunk)
        if b"\n" in buf:
            try:
                pid = json.loads(buf.split(b"\n", 1)[0])["child-pid"]
            except (ValueError, KeyError, TypeError):
                pid = None
            fut.done() or fut.set_result(pid)

    os.set_blocking(fd, False)
    loop.add_reader(fd, on_readable)
    try:
        return await asyncio.wait_for(fut, timeout)
    except TimeoutError:
        return None
    finally:
        loop.remove_reader(fd)


class ProcessBackend:
    """Runs programs under bubblewrap with per-run cgroups and rlimits (see module docstring)."""

    name = "process"

    def __init__(self, settings: SandboxSettings) -> None:
        self.settings = settings
        self.isolated = not settings.insecure_no_isolation
        self.bwrap: str | None = None
        self.root: Path | None = None
        self.cgroups = CgroupPool(settings.cgroup_pool_size or settings.concurrency * 2)
        self._prefix: list[str] = []
        self._devnull = -1
        self._ids = itertools.count(1)
        self._running = 0
        self._runs = 0
        self._started = False
        self._reaping: set[asyncio.Task[None]] = set()
        self._cgroup_writer = ThreadPoolExecutor(1, thread_name_prefix="sandboxd-cgroup")
        target = settings.warm_sandboxes
        self._warm_target = settings.concurrency if target < 0 else target
        self._warm: dict[tuple[str, ...], list[_Warm]] = {}
        self._fillers: dict[tuple[str, ...], asyncio.Task[None]] = {}
        self._warm_hits = 0
        self._compiles = 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        s = self.settings
        self.bwrap = s.bwrap_path or shutil.which("bwrap")
        if self.isolated:
            if self.bwrap is None or not os.access(self.bwrap, os.X_OK):
                raise SandboxUnavailable(f"bwrap not found. {BWRAP_INSTALL_HINT}")
            self._prefix = [
                self.bwrap,
                "--unshare-all",
                "--die-with-parent",
                "--new-session",
                "--as-pid-1",
                "--uid", str(SANDBOX_UID),
                "--gid", str(SANDBOX_UID),
                "--cap-drop", "ALL",
                "--hostname", "sandbox",
                *_system_binds(),
                "--proc", "/proc",
                "--dev", "/dev",
                "--tmpfs", "/tmp",
                "--clearenv",
                *itertools.chain.from_iterable(("--setenv", k, v) for k, v in CHILD_ENV.items()),
            ]  # fmt: skip
            probe = subprocess.run(
                [*self._prefix, "--", "/usr/bin/true"], capture_output=True, timeout=30
            )
            if probe.returncode != 0:
                raise SandboxUnavailable(
                    f"bwrap at {self.bwrap} cannot create a sandbox here: "
                    f"{probe.stderr.decode(errors='replace').strip()} (it needs user/PID/network "
                    "namespaces; in a container run it privileged, or use the docker backend)"
                )
        root_parent = Path(s.workdir_root) if s.workdir_root else _default_workdir_root()
        root_parent.mkdir(parents=True, exist_ok=True)
        self._reap_stale_workdirs(root_parent)
        self.root = root_parent / f"{PREFIX}{os.getpid()}"
        self.root.mkdir(mode=0o700, exist_ok=True)
        self.cgroups.start()
        self._devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._started = True
        if not self.isolated:
            self._warm_target = 0  # warm sandboxes are bwrap sandboxes
        if self.isolated and self._warm_target:
            for name in s.warm_languages:
                lang = get_language(name)
                if not lang.compiled:
                    self._kick(lang.run_argv)

    @staticmethod
    def _reap_stale_workdirs(parent: Path) -> None:
        with contextlib.suppress(OSError):
            for d in parent.glob(f"{PREFIX}*"):
                pid = d.name.removeprefix(PREFIX)
                if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                    shutil.rmtree(d, ignore_errors=True)

    async def close(self) -> None:
        self._started = False
        for task in list(self._fillers.values()):
            task.cancel()
        await asyncio.gather(*self._fillers.values(), return_exceptions=True)
        warm = [w for ws in self._warm.values() for w in ws]
        self._warm.clear()
        for w in warm:
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.child_pid, signal.SIGKILL)
        for w in warm:
            self._dispose(w, wait=True)
        if self._reaping:
            await asyncio.gather(*self._reaping, return_exceptions=True)
        await self.cgroups.close()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
        if self._devnull >= 0:
            os.close(self._devnull)
            self._devnull = -1
        self._cgroup_writer.shutdown(wait=True)

    def status(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "isolation": "bubblewrap" if self.isolated else "none (insecure_no_isolation)",
            "bwrap": self.bwrap,
            "running": self._running,
            "runs_total": self._runs,
            "compiles_total": self._compiles,
            "cgroups": self.cgroups.controllers or self.cgroups.unavailable_reason,
            "cgroups_draining": self.cgroups.draining,
            "workdir_root": str(self.root) if self.root else None,
            "warm": {" ".join(k): len(v) for k, v in self._warm.items()},
            "warm_target": self._warm_target,
            "warm_hits": self._warm_hits,
            # what the idle warm sandboxes hold (so operators and leak checks can tell them apart)
            "warm_pids": sorted(
                pid for ws in self._warm.values() for w in ws for pid in (w.proc.pid, w.child_pid)
            ),
            "warm_workdirs": sorted(w.workdir.name for ws in self._warm.values() for w in ws),
        }

    # ------------------------------------------------------------------ warm sandboxes

    def _kick(self, key: tuple[str, ...]) -> None:
        if self._started and key not in self._fillers:
            self._fillers[key] = asyncio.get_running_loop().create_task(self._fill(key))

    async def _fill(self, key: tuple[str, ...]) -> None:
        failures = 0
        try:
            while self._started and len(self._warm.setdefault(key, [])) < self._warm_target:
                w = await self._spawn_warm(key)
                if w is None:
                    failures += 1
                    if failures >= 5:
                        return  # the cold path still works; do not spin
                    await asyncio.sleep(0.2 * failures)
                    continue
                if not self._started:
                    os.kill(w.child_pid, signal.SIGKILL)
                    self._dispose(w, wait=True)
                    return
                self._warm[key].append(w)
        finally:
            self._fillers.pop(key, None)

    def _take_warm(self, key: tuple[str, ...]) -> _Warm | None:
        pool = self._warm.get(key)
        w = pool.pop() if pool else None
        self._kick(key)
        if w is not None:
            self._warm_hits += 1
        return w

    async def _spawn_warm(self, argv: tuple[str, ...]) -> _Warm | None:
        assert self.root is not None
        workdir = Path(tempfile.mkdtemp(prefix="run-", dir=self.root))
        slot = self.cgroups.acquire()
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        blk_r, blk_w = os.pipe2(os.O_CLOEXEC)
        st_r, st_w = os.pipe2(os.O_CLOEXEC)
        proc = None
        try:
            proc = subprocess.Popen(
                [
                    *self._prefix,
                    "--bind",
                    str(workdir),
                    SANDBOX_DIR,
                    "--chdir",
                    SANDBOX_DIR,
                    "--block-fd",
                    str(blk_r),
                    "--json-status-fd",
                    str(st_w),
                    "--",
                    *argv,
                ],  # fmt: skip
                stdin=in_r,
                stdout=out_w,
                stderr=err_w,
                pass_fds=(blk_r, st_w),
                env={},
                close_fds=True,
            )
        except OSError:
            pass
        for fd in (in_r, out_w, err_w, blk_r, st_w):
            os.close(fd)
        child_pid = await _read_child_pid(st_r) if proc is not None else None
        w = _Warm(argv, proc, child_pid or 0, workdir, slot, in_w, out_r, err_r, blk_w, st_r)  # type: ignore[arg-type]
        try:
            if proc is None or child_pid is None:
                raise OSError("bwrap did not start the sandbox")
            if slot is not None:
                await asyncio.get_running_loop().run_in_executor(
                    self._cgroup_writer, slot.attach, child_pid, ("pids", "memory")
                )
            return w
        except (OSError, asyncio.CancelledError) as exc:
            if child_pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child_pid, signal.SIGKILL)
            if proc is not None:
                proc.kill()
            self._dispose(w, wait=True)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return None

    def _dispose(self, w: _Warm, *, wait: bool) -> None:
        """Free an unused (killed) warm sandbox: reap bwrap, close fds, drop dir and slot."""
        if w.proc is not None and wait:
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
        for fd in (w.stdin_w, *w.parent_fds()):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(w.workdir, ignore_errors=True)
        if w.slot is not None:
            self.cgroups.release(w.slot)

    # ------------------------------------------------------------------ one program

    async def run(self, spec: RunSpec, deadline: Deadline) -> RunResult:
        if not self._started or self.root is None:
            raise SandboxUnavailable("process backend is not started")
        try:
            lang = get_language(spec.language)
        except UnknownLanguage as exc:
            return RunResult(message=str(exc), backend=self.name)
        run_id = f"proc-{os.getpid()}-{next(self._ids)}"
        self._runs += 1
        self._running += 1
        warm = None
        if (
            self._warm_target
            and lang.name in self.settings.warm_languages
            and not lang.compiled
            and len(spec.stdin) <= WARM_STDIN_MAX
        ):
            warm = self._take_warm(lang.run_argv)
        if warm is not None:
            workdir, slot = warm.workdir, warm.slot
        else:
            workdir = Path(tempfile.mkdtemp(prefix="run-", dir=self.root))
            slot = self.cgroups.acquire()
        try:
            return await self._run_in(spec, lang, workdir, slot, deadline, run_id, warm)
        finally:
            self._running -= 1
            if warm is not None and not warm.used:  # never started: kill it, reap in background
                with contextlib.suppress(ProcessLookupError):
                    os.kill(warm.child_pid, signal.SIGKILL)
                self._track(asyncio.get_running_loop().create_task(self._dispose_later(warm)))
            else:
                shutil.rmtree(workdir, ignore_errors=True)
                if slot is not None:
                    self.cgroups.release(slot)

    async def _dispose_later(self, w: _Warm) -> None:
        end = time.monotonic() + 10
        while w.proc.poll() is None and time.monotonic() < end:
            await asyncio.sleep(0.01)
        self._dispose(w, wait=True)

    async def _run_in(
        self,
        spec: RunSpec,
        lang: Language,
        workdir: Path,
        slot: CgroupSlot | None,
        deadline: Deadline,
        run_id: str,
        warm: _Warm | None = None,
    ) -> RunResult:
        result = RunResult(sandbox_id=run_id, backend=self.name)
        try:
            for name, content in spec.files.items():
                target = workdir / safe_relative_path(name)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
            (workdir / lang.source_file).write_text(spec.code)
        except (InvalidPath, OSError) as exc:
            result.message = f"could not prepare the working dir: {exc}"
            return result
        if spec.prebuilt is not None and lang.artifact is not None:
            try:
                artifact = workdir / lang.artifact
                artifact.write_bytes(spec.prebuilt)
                artifact.chmod(0o755)
            except OSError as exc:
                result.message = f"could not prepare the working dir: {exc}"
                return result
        elif lang.compile_argv is not None:
            self._compiles += 1
            result.compile = await self._exec(
                list(lang.compile_argv), workdir, spec.compile_limits, b"", deadline, slot
            )
            if result.compile.status != ExecStatus.FINISHED or result.compile.exit_code != 0:
                result.message = "compilation failed"
                return result
            if slot is not None:
                slot.reset()
        result.run = await self._exec(
            list(lang.run_argv), workdir, spec.run_limits, spec.stdin.encode(), deadline, slot, warm
        )
        result.files = self._fetch(workdir, spec.fetch_files, spec.run_limits)
        return result

    async def compile(self, spec: RunSpec, deadline: Deadline) -> tuple[ExecResult, bytes | None]:
        """Compile once (for many runs of the same program): the result and the artifact."""
        if not self._started or self.root is None:
            raise SandboxUnavailable("process backend is not started")
        lang = get_language(spec.language)
        if lang.compile_argv is None or lang.artifact is None:
            raise ValueError(f"{lang.name} has no compile step")
        workdir = Path(tempfile.mkdtemp(prefix="run-", dir=self.root))
        slot = self.cgroups.acquire()
        self._running += 1
        self._compiles += 1
        try:
            for name, content in spec.files.items():
                target = workdir / safe_relative_path(name)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(content)
            (workdir / lang.source_file).write_text(spec.code)
            result = await self._exec(
                list(lang.compile_argv), workdir, spec.compile_limits, b"", deadline, slot
            )
            artifact = None
            if result.status == ExecStatus.FINISHED and result.exit_code == 0:
                with contextlib.suppress(OSError):
                    artifact = self._fetch(workdir, [lang.artifact], Limits()).get(lang.artifact)
            return result, artifact
        finally:
            self._running -= 1
            shutil.rmtree(workdir, ignore_errors=True)
            if slot is not None:
                self.cgroups.release(slot)

    def _fetch(self, workdir: Path, names: list[str], limits: Limits) -> dict[str, bytes]:
        """Read requested files, refusing symlinks and anything outside the working dir."""
        out: dict[str, bytes] = {}
        cap = limits.max_output_bytes or self.settings.max_output_bytes
        real_root = os.path.realpath(workdir)
        for name in names:
            try:
                rel = safe_relative_path(name)
            except InvalidPath:
                continue
            path = workdir / rel
            if not os.path.realpath(path.parent).startswith(real_root):
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if (st.st_mode & 0o170000) == 0o100000 and st.st_size <= cap:
                    out[name] = os.read(fd, st.st_size) if st.st_size else b""
            finally:
                os.close(fd)
        return out

    def _limits(self, limits: Limits, deadline: Deadline) -> _StepLimits:
        s = self.settings
        wall = min(limits.wall_time_s, deadline.remaining())
        mem_mb = limits.memory_mb or s.default_memory_mb
        return _StepLimits(
            wall_s=wall,
            cpu_s=math.ceil(limits.cpu_time_s or limits.wall_time_s) + 1,
            memory_bytes=mem_mb * 1024 * 1024,
            pids=limits.max_processes or s.max_processes,
            nofile=limits.max_open_files or s.max_open_files,
            fsize_bytes=(limits.max_file_size_mb or s.max_file_size_mb) * 1024 * 1024,
            output_bytes=limits.max_output_bytes or s.default_output_bytes,
            cpu_cores=limits.cpu_limit,
        )

    def _rlimits(self, lim: _StepLimits, with_cgroup_memory: bool) -> list[tuple[int, int]]:
        # With the memory cgroup bounding resident memory, the address-space limit only has to
        # stop absurd allocations early; without it, it is the memory limit.
        assert lim.memory_bytes is not None
        address_space = (
            lim.memory_bytes * 2 + (512 << 20) if with_cgroup_memory else lim.memory_bytes
        )
        return [
            (resource.RLIMIT_CPU, lim.cpu_s),
            (resource.RLIMIT_AS, address_space),
            (resource.RLIMIT_FSIZE, lim.fsize_bytes),
            (resource.RLIMIT_NOFILE, lim.nofile),
            (resource.RLIMIT_CORE, 0),
            (resource.RLIMIT_STACK, min(lim.memory_bytes, 256 << 20)),
        ]

    async def _exec(
        self,
        argv: list[str],
        workdir: Path,
        limits: Limits,
        stdin: bytes,
        deadline: Deadline,
        slot: CgroupSlot | None,
        warm: _Warm | None = None,
    ) -> ExecResult:
        lim = self._limits(limits, deadline)
        if lim.wall_s <= 0:
            return ExecResult(
                status=ExecStatus.TIME_LIMIT, message="the request deadline expired before start"
            )
        if slot is not None:
            try:
                slot.configure(
                    memory_bytes=lim.memory_bytes, pids_max=lim.pids, cpu_cores=lim.cpu_cores
                )
            except OSError as exc:
                return ExecResult(status=ExecStatus.ERROR, message=f"cgroup set-up failed: {exc}")
        stdin_fd = self._devnull if warm is not None else self._stdin_fd(stdin)
        execution = _Execution(self, argv, workdir, lim, slot, stdin_fd, warm, stdin)
        try:
            return await execution.run()
        finally:
            if stdin_fd != self._devnull:
                os.close(stdin_fd)
            execution.cleanup()

    def _stdin_fd(self, data: bytes) -> int:
        if not data:
            return self._devnull
        assert self.root is not None
        fd, path = tempfile.mkstemp(prefix="stdin-", dir=self.root)
        os.unlink(path)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def _track(self, task: asyncio.Task[None]) -> None:
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)


class _Execution:
    """One sandboxed process: spawn, handshake, read output, enforce limits, reap."""

    def __init__(
        self,
        backend: ProcessBackend,
        argv: list[str],
        workdir: Path,
        lim: _StepLimits,
        slot: CgroupSlot | None,
        stdin_fd: int,
        warm: _Warm | None = None,
        stdin: bytes = b"",
    ) -> None:
        self.backend = backend
        self.warm = warm
        self.stdin = stdin
        self.argv = argv
        self.workdir = workdir
        self.lim = lim
        self.slot = slot
        self.stdin_fd = stdin_fd
        self.loop = asyncio.get_running_loop()
        self.proc: subprocess.Popen[bytes] | None = None
        self.child_pid: int | None = None
        self.pidfd = -1
        self.fds: list[int] = []
        self.buffers = {"stdout": bytearray(), "stderr": bytearray()}
        self.truncated = {"stdout": False, "stderr": False}
        self.readers: dict[int, str] = {}
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
        if self.warm is not None:
            w = self.warm
            w.used = True
            self.proc, self.child_pid = w.proc, w.child_pid
            self.fds += w.parent_fds()
            out_r, err_r = w.out_r, w.err_r
            ok = await self._arm_warm(w)
            if not ok:
                await self._wait_exit(EXIT_GRACE_S)
                return ExecResult(status=ExecStatus.ERROR, message=self.kill_message)
            return await self._supervise(out_r, err_r)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        self.fds += [out_r, err_r]
        child_fds = [out_w, err_w]
        try:
            if self.backend.isolated:
                ok = await self._spawn_bwrap(out_w, err_w, child_fds)
            else:
                ok = self._spawn_direct(out_w, err_w)
        except OSError as exc:
            return ExecResult(
                status=ExecStatus.ERROR, message=f"could not start the program: {exc}"
            )
        finally:
            for fd in child_fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if not ok:
            await self._wait_exit(EXIT_GRACE_S)
            return ExecResult(
                status=ExecStatus.ERROR,
                stderr=self.buffers["stderr"].decode(errors="replace"),
                message=self.kill_message or "the sandbox failed to start",
            )
        return await self._supervise(out_r, err_r)

    async def _arm_warm(self, w: _Warm) -> bool:
        """Give a warm sandbox this run's limits and stdin, then let it exec."""
        try:
            if self.slot is not None and self.lim.cpu_cores:
                await self.loop.run_in_executor(
                    self.backend._cgroup_writer, self.slot.attach, w.child_pid, ("cpu",)
                )
            with_memcg = self.slot is not None and "memory" in self.slot.dirs
            for res, value in self.backend._rlimits(self.lim, with_memcg):
                resource.prlimit(w.child_pid, res, (value, value))
            if self.slot is not None:
                self.slot.reset()  # measure from here: the warm child's own charge is baseline
            view = memoryview(self.stdin)
            while view:  # at most WARM_STDIN_MAX bytes: fits in the pipe, never blocks
                view = view[os.write(w.stdin_w, view) :]
            os.close(w.stdin_w)
            os.write(w.blk_w, b"x")
            return True
        except (OSError, ValueError) as exc:
            self.kill_message = f"could not start the warm sandbox: {exc}"
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.child_pid, signal.SIGKILL)
            return False

    async def _supervise(self, out_r: int, err_r: int) -> ExecResult:
        self.started_at = time.monotonic()
        for fd, stream in ((out_r, "stdout"), (err_r, "stderr")):
            os.set_blocking(fd, False)
            self.readers[fd] = stream
            self.loop.add_reader(fd, self._on_output, fd)
        self.pidfd = os.pidfd_open(self.proc.pid)  # type: ignore[union-attr]
        self.loop.add_reader(self.pidfd, self._on_exit)
        self.timer = self.loop.call_later(self.lim.wall_s, self._on_timeout)
        try:
            await self.done
        except asyncio.CancelledError:
            self.kill(ExecStatus.ERROR, "the request was cancelled")
            raise
        return self._result()

    async def _spawn_bwrap(self, out_w: int, err_w: int, child_fds: list[int]) -> bool:
        blk_r, blk_w = os.pipe2(os.O_CLOEXEC)
        st_r, st_w = os.pipe2(os.O_CLOEXEC)
        self.fds += [blk_w, st_r]
        child_fds += [blk_r, st_w]
        argv = [
            *self.backend._prefix,
            "--bind", str(self.workdir), SANDBOX_DIR,
            "--chdir", SANDBOX_DIR,
            "--block-fd", str(blk_r),
            "--json-status-fd", str(st_w),
            "--", *self.argv,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            argv,
            stdin=self.stdin_fd,
            stdout=out_w,
            stderr=err_w,
            pass_fds=(blk_r, st_w),
            env={},
            close_fds=True,
        )
        os.close(st_w)
        child_fds.remove(st_w)
        self.child_pid = await _read_child_pid(st_r)
        if self.child_pid is None:
            self.kill_message = "bwrap did not start the sandbox"
            return False
        try:
            if self.slot is not None:
                # A task migration can wait on an RCU grace period: keep it off the event loop.
                await self.loop.run_in_executor(
                    self.backend._cgroup_writer, self.slot.attach, self.child_pid
                )
            rlimits = self.backend._rlimits(
                self.lim, self.slot is not None and "memory" in self.slot.dirs
            )
            for res, value in rlimits:
                resource.prlimit(self.child_pid, res, (value, value))
        except (OSError, ValueError) as exc:
            self.kill_message = f"could not apply limits: {exc}"
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child_pid, signal.SIGKILL)
            return False
        os.write(blk_w, b"x")
        return True

    def _spawn_direct(self, out_w: int, err_w: int) -> bool:
        """insecure_no_isolation: the program runs as a plain child (cgroup + rlimits only)."""
        procs_files = (
            [str(d / "cgroup.procs") for d in self.slot.dirs.values()] if self.slot else []
        )
        rlimits = self.backend._rlimits(
            self.lim, self.slot is not None and "memory" in self.slot.dirs
        )

        def enter_limits() -> None:  # runs in the child between fork and exec
            for path in procs_files:
                with open(path, "w") as f:
                    f.write("0")
            for res, value in rlimits:
                resource.setrlimit(res, (value, value))

        self.proc = subprocess.Popen(
            self.argv,
            stdin=self.stdin_fd,
            stdout=out_w,
            stderr=err_w,
            cwd=self.workdir,
            env=dict(CHILD_ENV),
            close_fds=True,
            start_new_session=True,
            preexec_fn=enter_limits,
        )
        self.child_pid = self.proc.pid
        return True

    # -------------------------------------------------------------- events

    def _on_output(self, fd: int) -> None:
        stream = self.readers.get(fd)
        if stream is None:
            return
        try:
            chunk = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close_reader(fd)
            self._maybe_done()
            return
        self._take(stream, chunk)

    def _take(self, stream: str, chunk: bytes) -> None:
        """Keep output up to the cap; past it, kill the program (OutputLimitExceeded)."""
        buf = self.buffers[stream]
        room = self.lim.output_bytes - len(buf)
        if len(chunk) > room:
            buf.extend(chunk[: max(room, 0)])
            self.truncated[stream] = True
            if self.kill_reason is None:
                self.kill(
                    ExecStatus.OUTPUT_LIMIT,
                    f"{stream} exceeded {self.lim.output_bytes} bytes; the program was killed",
                )
            return
        buf.extend(chunk)

    def _close_reader(self, fd: int) -> None:
        if self.readers.pop(fd, None) is not None:
            self.loop.remove_reader(fd)

    def _on_exit(self) -> None:
        self.loop.remove_reader(self.pidfd)
        self.ended_at = time.monotonic()
        assert self.proc is not None
        # wait4 rather than Popen.wait: the rusage carries the CPU time of the program and of
        # every descendant it (or, at namespace teardown, the kernel) reaped.
        try:
            _, status, usage = os.wait4(self.proc.pid, 0)
            self.proc.returncode = os.waitstatus_to_exitcode(status)
            self.cpu_time_s = usage.ru_utime + usage.ru_stime
        except ChildProcessError:  # reaped elsewhere: keep what Popen knows
            self.proc.poll()
        self.exited = True
        if self.slot is not None and self.slot.task_count():
            self.slot.kill_all()  # backstop (insecure mode: daemons; bwrap: nothing should be left)
        if self.kill_reason is not None:
            # Everything is dead: do not wait for EOF from a pipe someone leaked.
            for fd in list(self.readers):
                self._drain_nonblocking(fd)
        elif self.readers:
            # The program is gone but a pipe is still open (without isolation, a daemon may
            # hold it): take what is there shortly, then stop waiting.
            self.loop.call_later(0.5, self._stop_reading)
        self._maybe_done()

    def _stop_reading(self) -> None:
        for fd in list(self.readers):
            self._drain_nonblocking(fd)
        self._maybe_done()

    def _drain_nonblocking(self, fd: int) -> None:
        """Take whatever is buffered in the pipe now, then stop reading it."""
        stream = self.readers.get(fd)
        while stream is not None and not self.truncated[stream]:
            try:
                chunk = os.read(fd, READ_CHUNK)
            except BlockingIOError:
                break
            except OSError:
                break
            if not chunk:
                break
            self._take(stream, chunk)
        self._close_reader(fd)

    def _on_timeout(self) -> None:
        self.timer = None
        if not self.exited:
            self.kill(
                ExecStatus.TIME_LIMIT, f"wall-clock limit of {self.lim.wall_s:.3g} s exceeded"
            )

    def _maybe_done(self) -> None:
        if self.exited and not self.readers and not self.done.done():
            self.done.set_result(None)

    def kill(self, reason: ExecStatus, message: str) -> None:
        """SIGKILL the program (its PID namespace follows) and every task left in its cgroup."""
        if self.kill_reason is None:
            self.kill_reason = reason
            self.kill_message = message
        if self.exited:
            return
        if self.child_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                if self.backend.isolated:
                    os.kill(self.child_pid, signal.SIGKILL)
                else:
                    os.killpg(self.child_pid, signal.SIGKILL)
        if self.slot is not None:
            with contextlib.suppress(OSError):
                self.slot.kill_all()
        # bwrap reaps the program and exits by itself; if it has not within the grace, kill it.
        self.loop.call_later(EXIT_GRACE_S, self._kill_bwrap)

    def _kill_bwrap(self) -> None:
        if not self.exited and self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    async def _wait_exit(self, timeout: float) -> None:
        """After a failed start: reap bwrap and keep what it said on stderr."""
        if self.proc is None:
            return
        end = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < end:
            await asyncio.sleep(0.005)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.exited = True
        err_r = self.fds[1]
        with contextlib.suppress(OSError):
            os.set_blocking(err_r, False)
            self.buffers["stderr"].extend(os.read(err_r, READ_CHUNK))

    # -------------------------------------------------------------- results

    def _result(self) -> ExecResult:
        assert self.proc is not None
        rc = self.proc.returncode
        stats = self.slot.stats() if self.slot is not None else None
        exit_code: int | None = rc
        sig: int | None = None
        if rc is not None and rc < 0:  # bwrap (or a direct child) itself killed
            sig = -rc
        elif self.backend.isolated and rc is not None and 128 < rc <= 128 + 64:
            sig = rc - 128  # bwrap reports a signal death of the program as 128 + signal
        if sig is not None:
            exit_code = -sig
        status = ExecStatus.FINISHED
        message = ""
        if self.kill_reason is not None:
            status, message = self.kill_reason, self.kill_message
        elif stats is not None and (
            stats.oom_killed
            or (stats.hit_memory_limit and rc != 0 and self._near_memory_limit(stats))
        ):
            status = ExecStatus.MEMORY_LIMIT
            message = f"memory limit of {self.lim.memory_bytes // (1 << 20)} MB exceeded"
        elif (
            sig == signal.SIGKILL
            and stats is not None
            and self.cpu_time_s is not None
            and (self.cpu_time_s >= self.lim.cpu_s - 1.5)
        ):
            status = ExecStatus.TIME_LIMIT
            message = f"CPU-time limit of {self.lim.cpu_s} s exceeded"
        elif sig == signal.SIGXFSZ:
            message = "file size limit exceeded"
        return ExecResult(
            status=status,
            exit_code=exit_code,
            signal=sig,
            stdout=self.buffers["stdout"].decode(errors="replace"),
            stderr=self.buffers["stderr"].decode(errors="replace"),
            stdout_truncated=self.truncated["stdout"],
            stderr_truncated=self.truncated["stderr"],
            wall_time_s=round((self.ended_at or time.monotonic()) - self.started_at, 6),
            cpu_time_s=round(self.cpu_time_s, 6) if self.cpu_time_s is not None else None,
            peak_memory_kb=stats.peak_memory_kb if stats else None,
            message=message,
        )

    def _near_memory_limit(self, stats: CgroupStats) -> bool:
        """A failing program that pushed against its memory limit (not just page-cache reclaim)."""
        if self.lim.memory_bytes is None or stats.peak_memory_kb is None:
            return False
        return stats.peak_memory_kb * 1024 >= 0.8 * self.lim.memory_bytes

    def cleanup(self) -> None:
        """Synchronous and idempotent: nothing of this execution survives it, even on cancel."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if not self.exited and self.proc is not None:
            self.kill(self.kill_reason or ExecStatus.ERROR, self.kill_message or "cancelled")
            self.backend._track(self.loop.create_task(self._reap_later()))
        for fd in list(self.readers):
            self.loop.remove_reader(fd)
        self.readers.clear()
        if self.pidfd >= 0 and not self.exited:
            with contextlib.suppress(Exception):
                self.loop.remove_reader(self.pidfd)
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()
        if self.pidfd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.pidfd)
            self.pidfd = -1

    async def _reap_later(self) -> None:
        assert self.proc is not None
        end = time.monotonic() + 10.0
        while self.proc.poll() is None and time.monotonic() < end:
            await asyncio.sleep(0.01)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)
