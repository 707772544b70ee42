"""The bubblewrap sandbox: its argv, and the one blocked-start handshake warm and cold runs share.

    bwrap --unshare-all --die-with-parent ... [--as-pid-1] --block-fd B --json-status-fd S -- ARGV

bwrap reports the sandboxed child's pid on S and then waits on B, so before any user code runs
the service moves that child into the run's cgroup and sets its rlimits; then it writes one byte
to B (`Blocked.unblock`). A warm sandbox is the same `Blocked` made ahead of time.

The child is the PID 1 of the sandbox's PID namespace: bwrap's own init, which forks the program
after B (so the program inherits the cgroup and rlimits) and exits with it, the kernel then
killing whatever the program left in the namespace. The kernel spares an init the signals it sends
itself, so a program that is its namespace's init cannot die of its own `abort()` (a failed C
`assert`, an uncaught C++ exception: SIGSEGV instead of SIGABRT) or `kill(getpid(), ...)`; bwrap's
init keeps the program out of that role. `--as-pid-1` (`as_init`) makes the program the init
itself, as a python fork-server case is, so that python behaves the same in both modes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..backend import SandboxUnavailable
from ..languages import CHILD_ENV

BWRAP_INSTALL_HINT = (
    "bubblewrap (bwrap) is required by the process backend for isolation: install it with "
    "`apt-get install bubblewrap` (Debian/Ubuntu) or `dnf install bubblewrap` (Fedora), or run "
    "`make run`, which installs it. To run programs WITHOUT any isolation (trusted code only), "
    "set TOOLENV_SANDBOX_INSECURE_NO_ISOLATION=1 (or `toolenv sandboxd serve "
    "--insecure-no-isolation`: `toolenv serve` has no such flag)."
)
SANDBOX_DIR = "/sandbox"  # where the run's working dir appears inside the sandbox
SANDBOX_UID = 65534
HANDSHAKE_TIMEOUT_S = 10.0
CANCELLED_HANDSHAKE_WAIT_S = 1.0  # for the child's pid, when the handshake is cancelled


# The program's user and group by name, as in the Docker image (the host's own lists stay out):
# without them `whoami`, `id -un` and python's `getpass.getuser()` failed on this backend only.
ACCOUNTS = {
    "/etc/passwd": Path(__file__).with_name("passwd.txt"),
    "/etc/group": Path(__file__).with_name("group.txt"),
}


def system_binds() -> list[str]:
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
    for etc, ours in ACCOUNTS.items():
        args += ["--ro-bind-try", str(ours), etc]
    return args


def interpreter_binds(python: str) -> list[str]:
    """Read-only binds of the Python interpreter's install prefix (and of its symlink target's)
    when they lie outside /usr."""
    binds: list[str] = []
    for path in dict.fromkeys((Path(python), Path(python).resolve())):
        prefix = path.parents[1]
        if prefix != Path("/usr") and Path("/usr") not in prefix.parents:
            binds += ["--ro-bind", str(prefix), str(prefix)]
    return binds


def sandbox_prefix(bwrap: str, python: str) -> list[str]:
    """The argv every sandbox starts with: all namespaces new, uid 65534, no capabilities."""
    return [
        bwrap,
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        "--uid", str(SANDBOX_UID),
        "--gid", str(SANDBOX_UID),
        "--cap-drop", "ALL",
        "--hostname", "sandbox",
        *system_binds(),
        *interpreter_binds(python),
        "--proc", "/proc",
        "--dev", "/dev",
        "--tmpfs", "/tmp",
        "--clearenv",
        *itertools.chain.from_iterable(("--setenv", k, v) for k, v in CHILD_ENV.items()),
    ]  # fmt: skip


def probe(prefix: list[str]) -> None:
    """Raise SandboxUnavailable when bwrap cannot build a sandbox on this host."""
    result = subprocess.run([*prefix, "--", "/usr/bin/true"], capture_output=True, timeout=30)
    if result.returncode != 0:
        raise SandboxUnavailable(
            f"bwrap at {prefix[0]} cannot create a sandbox here: "
            f"{result.stderr.decode(errors='replace').strip()} (it needs user/PID/network "
            "namespaces; in a container also CAP_SETFCAP, bwrap's seccomp rule and "
            "systempaths=unconfined, not privileged mode: see the sandbox service of "
            "compose/docker-compose.yml and docs/compose.md; or use the docker backend)"
        )


@dataclass
class Blocked:
    """A bwrap sandbox built and waiting on its block fd: the program has not started yet.

    `child_pid` is None when bwrap failed before reporting it (its stderr says why).
    `stdin_w` is the write end of the program's stdin pipe when the spawn made one.
    """

    proc: subprocess.Popen[bytes]
    child_pid: int | None
    out_r: int
    err_r: int
    blk_w: int
    st_r: int
    stdin_w: int | None = None
    closed: set[int] = field(default_factory=set)

    def parent_fds(self) -> list[int]:
        return [self.out_r, self.err_r, self.blk_w, self.st_r]

    def feed_stdin(self, data: bytes) -> None:
        """Write the whole stdin into the pipe (callers keep it within the pipe buffer)."""
        if self.stdin_w is None:
            return
        os.set_blocking(self.stdin_w, False)  # more than the buffer: an OSError, never a hang
        view = memoryview(data)
        while view:
            view = view[os.write(self.stdin_w, view) :]
        self.close_fd(self.stdin_w)

    def unblock(self) -> None:
        """Let bwrap exec the program."""
        os.write(self.blk_w, b"x")

    def kill_child(self) -> None:
        if self.child_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child_pid, signal.SIGKILL)

    def close_fd(self, fd: int | None) -> None:
        if fd is not None and fd not in self.closed:
            self.closed.add(fd)
            with contextlib.suppress(OSError):
                os.close(fd)

    def close_all(self) -> None:
        for fd in (self.stdin_w, *self.parent_fds()):
            self.close_fd(fd)


async def read_child_pid(fd: int, timeout: float = HANDSHAKE_TIMEOUT_S) -> int | None:
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


async def spawn_blocked(
    prefix: list[str],
    workdir: Path,
    argv: tuple[str, ...] | list[str],
    stdin_fd: int | None,
    as_init: bool = False,
) -> Blocked:
    """Start bwrap with `workdir` bound at /sandbox and wait until it reports the child's pid
    (bwrap's init, or with `as_init` the program itself: see the module's docstring).

    `stdin_fd` None: the program's stdin is a new pipe (`Blocked.stdin_w`). Raises OSError when
    bwrap cannot be started at all; a bwrap that dies early gives `child_pid` None.
    """
    stdin_w = None
    if stdin_fd is None:
        stdin_fd, stdin_w = os.pipe2(os.O_CLOEXEC)
        ours = [stdin_fd]
    else:
        ours = []
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    blk_r, blk_w = os.pipe2(os.O_CLOEXEC)
    st_r, st_w = os.pipe2(os.O_CLOEXEC)
    child_ends = [*ours, out_w, err_w, blk_r, st_w]
    try:
        proc = subprocess.Popen(
            [
                *prefix,
                *(("--as-pid-1",) if as_init else ()),
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
            stdin=stdin_fd,
            stdout=out_w,
            stderr=err_w,
            pass_fds=(blk_r, st_w),
            env={},
            close_fds=True,
            # Its own session: Ctrl-C in the terminal that runs the service (SIGINT to the
            # foreground process group) must not reach the sandbox; the service stops it.
            start_new_session=True,
        )
    except OSError:
        for fd in (out_r, err_r, blk_w, st_r, stdin_w):
            if fd is not None:
                os.close(fd)
        raise
    finally:
        for fd in child_ends:
            with contextlib.suppress(OSError):
                os.close(fd)
    blocked = Blocked(proc, None, out_r, err_r, blk_w, st_r, stdin_w)
    handshake = asyncio.ensure_future(read_child_pid(st_r))
    try:
        blocked.child_pid = await asyncio.shield(handshake)
    except BaseException:  # cancelled mid-handshake: nothing may outlive it
        await _kill_mid_handshake(blocked, handshake)
        raise
    return blocked


async def _kill_mid_handshake(blocked: Blocked, handshake: asyncio.Future[int | None]) -> None:
    """Kill bwrap and its child. bwrap clones the child, reports its pid, then lets it go on:
    bwrap killed before that left the child blocked for good (its --die-with-parent not yet
    set), an orphan holding its namespaces. So the report is awaited first (briefly)."""
    try:
        await asyncio.wait({handshake}, timeout=CANCELLED_HANDSHAKE_WAIT_S)
    finally:
        if not handshake.done():
            handshake.cancel()
            with contextlib.suppress(BaseException):
                await handshake  # its reader is gone before the fds are closed
        elif not handshake.cancelled() and handshake.exception() is None:
            blocked.child_pid = handshake.result()
        blocked.kill_child()
        blocked.proc.kill()
        blocked.proc.wait()
        blocked.close_all()
