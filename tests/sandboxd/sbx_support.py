"""sandboxd test support (imported by bare name, like gw_support): a real `toolenv sandboxd serve` on loopback, and leak snapshots.

`LeakProbe` looks at what a sandboxd server process owns from the outside: its descendant
processes, tasks in its per-run cgroups, its run dirs, its mount table and open fds, and
orphaned bwrap zombies; tests assert that all of it returns to the baseline after hostile runs.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from toolenv_core.net import free_port

SECRET = f"toolenv-secret-{secrets.token_hex(8)}"


def _stat(pid: int) -> tuple[str, int, str] | None:
    """(comm, ppid, state) of a process, None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    return comm, int(fields[1]), fields[0]


def all_processes() -> dict[int, tuple[str, int, str]]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            out[int(name)] = st
    return out


@dataclass
class Snapshot:
    descendants: list[int]
    cgroup_tasks: list[int]
    run_dirs: list[str]
    mounts: int
    fds: int
    orphan_zombies: set[int]

    def leaks_vs(self, base: Snapshot) -> list[str]:
        problems = []
        if self.descendants:
            problems.append(f"processes left under the server: {self.descendants}")
        if self.cgroup_tasks:
            problems.append(f"tasks left in run cgroups: {self.cgroup_tasks}")
        if self.run_dirs:
            problems.append(f"run dirs left: {self.run_dirs}")
        if self.mounts != base.mounts:
            problems.append(f"mount table changed: {base.mounts} -> {self.mounts}")
        if self.fds > base.fds + 8:
            problems.append(f"server fds grew: {base.fds} -> {self.fds}")
        if new := self.orphan_zombies - base.orphan_zombies:
            problems.append(f"new orphaned zombies: {sorted(new)}")
        return problems


class LeakProbe:
    """Idle warm sandboxes (listed by the server's status) are expected; nothing else is."""

    def __init__(self, server_pid: int, url: str) -> None:
        self.pid = server_pid
        self.url = url
        self.base: Snapshot | None = None

    def cgroup_dirs(self) -> list[Path]:
        dirs = []
        for line in Path(f"/proc/{self.pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(","):
                base = (
                    Path("/sys/fs/cgroup") / c / path.lstrip("/") / f"toolenv-sandboxd-{self.pid}"
                )
                if c and base.is_dir():
                    dirs += [d for d in base.iterdir() if d.is_dir()]
        return dirs

    def warm(self) -> tuple[set[int], set[str]]:
        status = httpx.get(self.url + "/v1/sandbox/status", timeout=10).json()
        return set(status.get("warm_pids", [])), set(status.get("warm_workdirs", []))

    def snapshot(self) -> Snapshot:
        warm_pids, warm_dirs = self.warm()
        procs = all_processes()
        children: dict[int, list[int]] = {}
        for pid, (_, ppid, _) in procs.items():
            children.setdefault(ppid, []).append(pid)
        descendants, stack = [], [self.pid]
        while stack:
            for child in children.get(stack.pop(), []):
                stack.append(child)  # listed or not, what runs under it is checked too
                if child not in warm_pids:  # an idle warm sandbox or fork-server process
                    descendants.append(child)
        tasks = []
        for d in self.cgroup_dirs():
            try:
                tasks += [
                    int(p)
                    for p in (d / "cgroup.procs").read_text().split()
                    if int(p) not in warm_pids
                ]
            except OSError:
                pass
        run_root = Path("/dev/shm") / f"toolenv-sandboxd-{self.pid}"
        run_dirs = sorted(set(os.listdir(run_root)) - warm_dirs) if run_root.is_dir() else []
        return Snapshot(
            descendants=sorted(descendants),
            cgroup_tasks=sorted(tasks),
            run_dirs=run_dirs,
            # Only mounts that could be the sandbox's: the host's table also changes whenever
            # Docker (another test, the docker backend's pool) starts or removes a container.
            mounts=sum(
                1
                for line in Path(f"/proc/{self.pid}/mountinfo").read_text().splitlines()
                if f"toolenv-sandboxd-{self.pid}" in line or "bwrap" in line or "newroot" in line
            ),
            fds=len(os.listdir(f"/proc/{self.pid}/fd")),
            orphan_zombies={
                p for p, (comm, ppid, state) in procs.items() if state == "Z" and ppid == 1
            },
        )

    def baseline(self) -> None:
        self.base = self.snapshot()

    def assert_clean(self, timeout: float = 10.0) -> None:
        """Clean-up may finish just after the response: allow it a moment, then insist."""
        assert self.base is not None
        end = time.monotonic() + timeout
        while True:
            problems = self.snapshot().leaks_vs(self.base)
            if not problems or time.monotonic() > end:
                break
            time.sleep(0.05)
        assert not problems, problems


class SandboxdServer:
    def __init__(self, url: str, proc: subprocess.Popen[bytes]) -> None:
        self.url = url
        self.proc = proc
        self.probe = LeakProbe(proc.pid, url)
        self.client = httpx.Client(base_url=url, timeout=60.0)

    def run_code(self, **body: object) -> dict:
        r = self.client.post("/run_code", json=body)
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_sandboxd(
    *args: str,
    env: dict[str, str] | None = None,
    cpu_cgroup: Path | None = None,
    wrap: list[str] | None = None,
) -> SandboxdServer:
    """`cpu_cgroup`: the server starts in that cpu cgroup (as in a container or a systemd unit).
    `wrap`: a command the server runs under (e.g. `setpriv` dropping capabilities)."""
    port = free_port()
    argv = [*(wrap or []), sys.executable, "-m", "toolenv", "sandboxd", "serve"]
    argv += ["--host", "127.0.0.1", "--port", str(port), *args]
    if cpu_cgroup is not None:  # the shell joins it, then becomes the server (same pid)
        argv = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cpu_cgroup), *argv]
    full_env = {**os.environ, "TOOLENV_TEST_SECRET": SECRET, **(env or {})}
    proc = subprocess.Popen(argv, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise RuntimeError(f"sandboxd exited with {proc.returncode}:\n{out}")
        try:
            if httpx.get(url + "/readyz", timeout=1.0).status_code == 200:
                return SandboxdServer(url, proc)
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("sandboxd did not become ready within 60 s")


def post(
    server: SandboxdServer, body: object, path: str = "/run_code", **kw: Any
) -> httpx.Response:
    """A JSON body POSTed to the server (default `/run_code`), its answer as it came."""
    return server.client.post(path, json=body, **kw)
