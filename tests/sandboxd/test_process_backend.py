"""The process backend in-process: refusal without bwrap, insecure mode, cancellation, admission."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from sandboxd.api import build_router
from sandboxd.backend import SandboxUnavailable
from sandboxd.models import Limits, RunResult, RunSpec
from sandboxd.process import ProcessBackend
from sandboxd.process.cgroup_slot import cpu_usage_file, parse_cpu_usage_us
from sandboxd.process.cgroups import _left_by_dead_instance
from sandboxd.service import SandboxService
from sandboxd.settings import SandboxSettings
from toolenv_core.deadline import Deadline


def settings(**kw: object) -> SandboxSettings:
    return SandboxSettings(max_concurrency=2, **kw)


async def test_refuses_to_start_without_bwrap_and_says_how_to_install() -> None:
    backend = ProcessBackend(settings(bwrap_path="/nonexistent/bwrap"))
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap") as err:
        await backend.start()
    # The same words reach `toolenv serve`'s 503s and /readyz: the flag is only sandboxd's own,
    # the variable works for both.
    assert "`toolenv sandboxd serve --insecure-no-isolation`" in str(err.value)
    assert "TOOLENV_SANDBOX_INSECURE_NO_ISOLATION=1" in str(err.value)


def test_serve_exits_with_the_install_hint_without_bwrap() -> None:
    env = {**os.environ, "TOOLENV_SANDBOX_BWRAP_PATH": "/nonexistent/bwrap"}
    out = subprocess.run(
        [sys.executable, "-m", "toolenv", "sandboxd", "serve", "--port", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "apt-get install bubblewrap" in out.stderr


async def test_insecure_mode_runs_without_bwrap() -> None:
    backend = ProcessBackend(settings(bwrap_path="/nonexistent/bwrap", insecure_no_isolation=True))
    await backend.start()
    try:
        assert backend.status()["isolation"].startswith("none")
        r = await backend.run(
            RunSpec(language="python", code="import os; print(os.getcwd() != '/sandbox')"),
            Deadline.after(30),
        )
        assert r.run is not None and r.run.stdout == "True\n"
        r = await backend.run(
            RunSpec(language="python", code="while True: pass", run_limits=Limits(wall_time_s=0.5)),
            Deadline.after(30),
        )
        assert r.run is not None and r.run.status == "TimeLimitExceeded"
        # a daemon that keeps stdout open neither holds the run nor survives it (cgroup backstop)
        daemon = (
            "import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"
            "        time.sleep(60)\n"
            "    os._exit(0)\n"
            "print('parent done', flush=True)\n"
        )
        r = await backend.run(
            RunSpec(language="python", code=daemon, run_limits=Limits(wall_time_s=20)),
            Deadline.after(30),
        )
        assert r.run is not None and r.run.stdout == "parent done\n"
        assert r.run.wall_time_s < 5
        for _ in range(100):
            if not any(
                (d / "cgroup.procs").read_text().strip()
                for base in backend.cgroups.bases.values()
                for d in base.iterdir()
                if d.is_dir()
            ):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the daemon survived its run")
    finally:
        await backend.close()
    assert backend.root is not None and not backend.root.exists()


async def test_a_cancelled_runs_late_end_report_leaves_its_slot_alone(bwrap_path: str) -> None:
    """The zygote reports a cancelled run's end after its slot was released (drained and
    removed, or pooled for another run): reading it raised FileNotFoundError in a loop
    callback (the fork server's top-up skipped); had the slot gone to another run, the
    backstop would have killed that run's program. Single runs and run_tests cases."""
    errors: list[object] = []
    asyncio.get_running_loop().set_exception_handler(
        lambda _loop, ctx: errors.append(ctx.get("exception") or ctx["message"])
    )
    backend = ProcessBackend(SandboxSettings(max_concurrency=4))
    await backend.start()
    spec = RunSpec(language="python", code="import time\ntime.sleep(60)")
    spec.run_limits.wall_time_s = 60

    async def case_run() -> None:
        async with backend.case_batch(spec, Deadline.after(60)) as batch:
            assert batch is not None
            await asyncio.gather(*(backend.run_case(batch, spec, Deadline.after(60)),) * 2)

    try:
        for _ in range(15):
            tasks = [
                asyncio.create_task(backend.run(spec, Deadline.after(60))),
                asyncio.create_task(case_run()),
            ]
            await asyncio.sleep(0.15)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(200):  # every report in, every slot drained
            if not backend.cgroups.draining and not backend.status()["running"]:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        assert not errors, errors
        r = await backend.run(RunSpec(language="python", code="print('next')"), Deadline.after(30))
        assert r.run is not None and r.run.stdout == "next\n"
    finally:
        await backend.close()


async def test_cancelled_run_is_killed_and_cleaned_up(bwrap_path: str) -> None:
    backend = ProcessBackend(settings())
    await backend.start()
    root = backend.root
    assert root is not None
    try:
        spec = RunSpec(
            language="python",
            code="import os, time\nos.fork(); os.fork()\ntime.sleep(60)",
            run_limits=Limits(wall_time_s=60),
        )
        task = asyncio.create_task(backend.run(spec, Deadline.after(60)))
        await asyncio.sleep(1.0)
        assert backend.status()["running"] == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        def leftovers() -> tuple[list[str], list[int]]:
            status = backend.status()  # idle warm sandboxes are expected, nothing else
            dirs = sorted({p.name for p in root.iterdir()} - set(status["warm_workdirs"]))
            tasks = [
                int(pid)
                for base in backend.cgroups.bases.values()
                for d in base.iterdir()
                if d.is_dir()
                for pid in (d / "cgroup.procs").read_text().split()
                if int(pid) not in status["warm_pids"]
            ]
            return dirs, tasks

        for _ in range(200):
            if leftovers() == ([], []) and not backend.cgroups.draining and not backend._reaping:
                break
            await asyncio.sleep(0.05)
        assert leftovers() == ([], [])
        r = await backend.run(RunSpec(language="python", code="print('next')"), Deadline.after(30))
        assert r.run is not None and r.run.stdout == "next\n"
    finally:
        await backend.close()
    assert not root.exists()
    # close() removed every cgroup it created
    for base in backend.cgroups.bases.values():
        assert not base.exists()


async def test_deadline_shorter_than_the_timeout_wins(bwrap_path: str) -> None:
    backend = ProcessBackend(settings())
    await backend.start()
    try:
        spec = RunSpec(
            language="python", code="import time; time.sleep(30)", run_limits=Limits(wall_time_s=30)
        )
        r = await backend.run(spec, Deadline.after(0.5))
        assert r.run is not None and r.run.status == "TimeLimitExceeded"
        assert r.run.wall_time_s < 3
    finally:
        await backend.close()


async def test_stale_leftovers_of_a_dead_instance_are_removed(
    bwrap_path: str, tmp_path: Path
) -> None:
    dead_pid = 2**22 + 12345  # above pid_max: never a live process
    stale = tmp_path / f"toolenv-sandboxd-{dead_pid}"
    (stale / "run-x").mkdir(parents=True)
    backend = ProcessBackend(settings(workdir_root=str(tmp_path)))
    await backend.start()
    try:
        assert not stale.exists()
    finally:
        await backend.close()


# ---------------------------------------------------------------- service without a real backend


class ExplodingBackend:
    """A backend that fails: the service must answer SandboxError in the body, never 500."""

    name = "exploding"
    deadline_margin_s = 0.0  # as `SandboxBackend` asks of every backend

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def run(self, spec: RunSpec, deadline: Deadline) -> RunResult:
        raise RuntimeError("engine gone")

    async def compile(self, spec: RunSpec, deadline: Deadline) -> None:
        return None

    def status(self) -> dict:
        return {}


async def test_backend_failure_is_sandbox_error_not_500() -> None:
    service = SandboxService(settings(), backend=ExplodingBackend())
    await service.start()
    app = FastAPI()
    app.include_router(build_router(service))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        r = await c.post("/run_code", json={"code": "print(1)"})
    await service.close()
    assert r.status_code == 200
    assert r.json()["status"] == "SandboxError"
    assert "engine gone" in r.json()["message"]


class NonsenseBackend(ExplodingBackend):
    async def run(self, spec: RunSpec, deadline: Deadline) -> RunResult:
        return None  # type: ignore[return-value]  # a bug anywhere past the backend call


async def test_any_failure_is_reported_in_the_body_not_500() -> None:
    service = SandboxService(settings(), backend=NonsenseBackend())
    await service.start()
    app = FastAPI()
    app.include_router(build_router(service))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        r = await c.post("/run_code", json={"code": "print(1)"})
        t = await c.post("/v1/run_tests", json={"code": "print(1)", "cases": [{}]})
    await service.close()
    assert r.status_code == 200 and r.json()["status"] == "SandboxError"
    assert t.status_code == 200 and t.json()["verdict"] == "sandbox_error"


async def test_python_programs_run_with_the_configured_interpreter(bwrap_path: str) -> None:
    # An interpreter outside /usr (the test venv's base Python): its prefix is bound read-only.
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    backend = ProcessBackend(settings(bwrap_path=bwrap_path, python=str(base), warm_sandboxes=0))
    await backend.start()
    try:
        assert backend.status()["python"] == str(base)
        r = await backend.run(
            RunSpec(language="python", code="import sys; print(sys.base_prefix)"),
            Deadline.after(30),
        )
        assert r.run is not None and r.run.stdout.strip() == sys.base_prefix, r
    finally:
        await backend.close()


async def test_a_missing_interpreter_is_refused_naming_the_setting() -> None:
    backend = ProcessBackend(settings(python="/nonexistent/python3"))
    with pytest.raises(SandboxUnavailable, match="TOOLENV_SANDBOX_PYTHON"):
        await backend.start()


async def test_an_interpreter_that_is_a_directory_is_refused_naming_the_setting(
    tmp_path: Path,
) -> None:
    # A directory is "executable" to os.access: sandboxd served, and every run of every language
    # was a SandboxError ("could not apply limits", bwrap "Can't mkdir /sandbox").
    backend = ProcessBackend(settings(python=str(tmp_path), insecure_no_isolation=True))
    try:
        with pytest.raises(SandboxUnavailable, match="TOOLENV_SANDBOX_PYTHON"):
            await backend.start()
    finally:
        await backend.close()


@pytest.mark.parametrize("isolated", [False, True])
async def test_a_service_without_isolation_says_so_at_start(
    isolated: bool, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Programs ran as root without a sandbox, and only /v1/sandbox/status said so."""
    service = SandboxService(
        settings(insecure_no_isolation=not isolated, workdir_root=str(tmp_path), warm_sandboxes=0)
    )
    try:
        await service.start()
    finally:
        await service.close()
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    said = [w for w in warned if w.startswith("insecure_no_isolation: programs run without")]
    assert len(said) == (0 if isolated else 1), warned
    assert isolated or f"(uid {os.getuid()})" in said[0]


async def test_a_workdir_root_that_is_a_file_is_refused_naming_the_setting(tmp_path: Path) -> None:
    # it was a bare FileExistsError: `toolenv serve`'s /readyz said only that
    root = tmp_path / "file"
    root.write_text("")
    backend = ProcessBackend(settings(workdir_root=str(root), insecure_no_isolation=True))
    try:
        with pytest.raises(SandboxUnavailable, match="TOOLENV_SANDBOX_WORKDIR_ROOT"):
            await backend.start()
    finally:
        await backend.close()


def serve_sandboxd(**env: str) -> subprocess.CompletedProcess[str]:
    """`toolenv sandboxd serve` with these TOOLENV_SANDBOX_* settings, without isolation (whether
    or not bwrap is installed is not what is tested): a start it refuses ends it."""
    settings = {f"TOOLENV_SANDBOX_{k.upper()}": v for k, v in env.items()}
    return subprocess.run(
        [sys.executable, "-m", "toolenv", "sandboxd", "serve", "--port", "0"],
        env={**os.environ, "TOOLENV_SANDBOX_INSECURE_NO_ISOLATION": "1", **settings},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_serve_exits_naming_the_setting_of_a_workdir_root_it_cannot_use(tmp_path: Path) -> None:
    # it was uvicorn's traceback of the app's start-up (FileExistsError), and exit 3
    (tmp_path / "file").write_text("")
    out = serve_sandboxd(workdir_root=str(tmp_path / "file" / "runs"))
    assert out.returncode == 2, out.stderr
    assert out.stderr == (
        f"error: the run directory root {tmp_path}/file/runs (sandbox.workdir_root, "
        f"TOOLENV_SANDBOX_WORKDIR_ROOT): {tmp_path}/file is a file, not a directory; name a "
        "writable directory\n"
    )


def test_serve_exits_naming_the_setting_without_an_interpreter() -> None:
    # It was uvicorn's 30-line traceback of the app's start-up, and exit 3 (a port not bound).
    out = serve_sandboxd(python="/nonexistent/python3")
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("error: no Python interpreter for sandboxed programs")
    assert "TOOLENV_SANDBOX_PYTHON" in out.stderr and "Traceback" not in out.stderr


def test_a_cgroup_left_by_a_dead_instance_is_told_from_a_live_one(tmp_path: Path) -> None:
    made = tmp_path / "toolenv-sandboxd-7"
    made.mkdir()
    assert not _left_by_dead_instance(made, os.getpid())
    assert not _left_by_dead_instance(made, 1)  # running since before the dir was made
    time.sleep(1.2)
    later = subprocess.Popen(["sleep", "30"])  # the pid reused, as after a container restart
    try:
        assert _left_by_dead_instance(made, later.pid)
    finally:
        later.kill()
        later.wait()
    assert _left_by_dead_instance(made, later.pid)  # no such process any more


def test_a_slots_cpu_time_is_read_from_cpuacct_or_a_v2_cpu_stat(tmp_path: Path) -> None:
    """cpuacct.usage in its own dir, or in the cpu dir when mounted as `cpu,cpuacct`; under v2,
    cpu.stat's usage_usec. Parsed from this host's real files where it has them."""
    own, shared, v2 = (tmp_path / n for n in ("cpuacct", "cpu,cpuacct", "v2"))
    for d in (own, shared, v2):
        d.mkdir()
    (own / "cpuacct.usage").write_text("1500000\n")
    (shared / "cpuacct.usage").write_text("0\n")
    (shared / "cpu.shares").write_text("1024\n")
    (v2 / "cpu.stat").write_text("usage_usec 1500\nuser_usec 1000\nsystem_usec 500\n")
    assert cpu_usage_file({"cpu": shared, "cpuacct": own}) == ("cpuacct", "cpuacct.usage")
    assert cpu_usage_file({"cpu": shared}) == ("cpu", "cpuacct.usage")
    assert cpu_usage_file({"cpu": v2}) == ("cpu", "cpu.stat")
    assert cpu_usage_file({"pids": v2}) is None
    assert parse_cpu_usage_us("cpuacct.usage", (own / "cpuacct.usage").read_text()) == 1500
    assert parse_cpu_usage_us("cpu.stat", (v2 / "cpu.stat").read_text()) == 1500
    host = {
        "cpuacct.usage": Path("/sys/fs/cgroup/cpuacct/cpuacct.usage"),
        "cpu.stat": Path("/sys/fs/cgroup/unified/cpu.stat"),  # a hybrid host's v2 hierarchy
    }
    for name, path in host.items():
        if path.exists():
            assert (parse_cpu_usage_us(name, path.read_text()) or 0) > 0, name
