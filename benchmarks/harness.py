"""The one harness every benchmark uses: a free loopback port, a server process spawned, waited
for until it answers its readiness path, measured from /proc, and stopped.

    with toolenv_server("emulators", "serve", "--profile", str(path)) as server:
        run_load(LoadSpec(url=server.url + "/retrieve", ...))
        server.cpu_s()

A server runs in its own session so that a stuck one is killed with its children; its stderr
goes to a temporary file (a pipe nobody reads would block a chatty server) and its tail is
quoted when it dies before it is ready.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import FrameType, TracebackType

import httpx

from toolenv_core.net import free_port
from toolenv_core.polytrace.cache import missing_trace_error, resolve_trace

from .cpu_budget import CLK_TCK, parse_cpu_lines

__all__ = [
    "ServerProcess",
    "free_port",
    "machine_busy_s",
    "positive_float",
    "polytrace_file",
    "report_path",
    "toolenv_server",
    "unwind_on_sigterm",
    "wait_until_idle",
    "write_report",
]


class ServerProcess:
    """A real server on 127.0.0.1:`port`, started by `start()` and stopped with SIGINT."""

    def __init__(
        self,
        argv: list[str],
        port: int,
        *,
        ready_path: str = "/readyz",
        ready_timeout_s: float = 60.0,
        stop_timeout_s: float = 10.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.argv = argv
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.ready_path = ready_path
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.env = None if env is None else {**os.environ, **env}
        self.proc: subprocess.Popen[bytes] | None = None
        self._stderr = tempfile.TemporaryFile()

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def start(self) -> ServerProcess:
        """Spawn the process and wait until `ready_path` answers 200 (or fail with its stderr)."""
        unwind_on_sigterm()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            env=self.env,
            start_new_session=True,
        )
        try:
            return self._wait_ready()
        except BaseException:  # Ctrl-C while waiting: its own session would outlive us
            self.stop()
            raise

    def _wait_ready(self) -> ServerProcess:
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{' '.join(self.argv[:5])} exited with {self.proc.returncode}: "
                    f"{self.stderr_tail()}"
                )
            try:
                if httpx.get(self.url + self.ready_path, timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.url} not ready within {self.ready_timeout_s:.0f} s")

    def stop(self) -> None:
        """SIGINT (a graceful drain), then SIGKILL to the whole session after `stop_timeout_s`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._stderr.close()

    def stderr_tail(self, chars: int = 2000) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-chars:]

    # ---- /proc counters (load-independent costs)
    def cpu_s(self) -> float:
        """User + system CPU seconds of the process so far."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def rss_kb(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def polytrace_file(name: str | Path | None, default: str) -> Path:
    """The trace a benchmark reads: `name` (a path, or a name in the trace cache, as every
    command takes one), else `default` under $TOOLENV_POLYTRACE_DIR when set (a local copy, as
    the tests read) or in the trace cache `toolenv traces fetch` fills. The default was a folder
    beside the repository's, which no clone elsewhere has. Raises TraceFormatError saying where
    it looked and how to fetch it."""
    root = os.environ.get("TOOLENV_POLYTRACE_DIR")
    wanted = name if name is not None else Path(root) / default if root else default
    path = resolve_trace(wanted)
    if not path.exists():
        raise missing_trace_error(wanted)
    return path


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def unwind_on_sigterm() -> None:
    """SIGTERM (`kill`, `timeout`, a cancelled job) unwinds like Ctrl-C, exit 143, so that the
    `with` and `finally` blocks stop the servers, clusters and containers they started: by
    default it ended the benchmark at once and left each server running in its own session.
    Only from the main thread, and only over the default disposition."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_signal)


def toolenv_server(
    *args: str,
    ready_timeout_s: float = 60.0,
    stop_timeout_s: float = 10.0,
    env: dict[str, str] | None = None,
    cpus: Iterable[int] | None = None,
) -> ServerProcess:
    """`python -m toolenv <args> --host 127.0.0.1 --port <free port>` (not started yet), pinned
    to `cpus` with taskset (threads included) when given."""
    port = free_port()
    argv = [sys.executable, "-m", "toolenv", *args, "--host", "127.0.0.1", "--port", str(port)]
    if cpus is not None:
        argv = ["taskset", "-c", ",".join(map(str, sorted(cpus))), *argv]
    return ServerProcess(
        argv, port, ready_timeout_s=ready_timeout_s, stop_timeout_s=stop_timeout_s, env=env
    )


def machine_busy_s() -> float:
    """CPU seconds the whole machine has spent busy (every CPU, /proc/stat), since boot."""
    return parse_cpu_lines(Path("/proc/stat").read_text())["cpu"][0] / CLK_TCK


def wait_until_idle(
    busy_below: float = 0.15, window_s: float = 0.2, timeout_s: float = 5.0
) -> bool:
    """Wait until the machine's busy share over `window_s` falls below `busy_below` (False at
    `timeout_s`): work a round leaves behind (a pool refilling, the kernel tearing namespaces
    down) then lands on no other round's clock."""
    cpus = os.cpu_count() or 1
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        before = machine_busy_s()
        time.sleep(window_s)
        if (machine_busy_s() - before) / (window_s * cpus) < busy_below:
            return True
    return False


def positive_float(value: str) -> float:
    """An argparse type for a rate or a duration: a finite number above 0. A rate of 0, -5 or
    `abc` was refused in a traceback by the load generator, after the servers and the baseline
    ran."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not math.isfinite(number) or number <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not a number above 0")
    return number


def report_path(value: str) -> Path:
    """An argparse type for `--out`/`--png`: a path the report can be written to, checked before
    the run (a missing folder under /proc, a read-only one or a directory given as the file
    failed in a traceback after the whole run). Makes nothing: the folder is made when written."""
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is a directory; give a file name")
    folder = next(p for p in (path.absolute().parent, *path.absolute().parents) if p.exists())
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {value}: {folder} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"cannot write {value}: no file can be made in {folder} ({exc.strerror})"
        ) from exc
    return path


def write_report(report: dict, out: Path | None) -> None:
    """A benchmark's JSON report: to `out` (its folder made if missing), or to stdout without one."""
    text = json.dumps(report, indent=2) + "\n"
    if out is None:
        print(text, end="")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
