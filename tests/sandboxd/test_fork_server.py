"""The python fork server against the warm-spawn path it replaces, on real bwrap sandboxes.

- every program of `fork_corpus/` (the hostile programs included) gives the same result forked
  from the zygote as started fresh (`python3 main.py` in a warm bwrap sandbox);
- nothing of one forked run is visible to the next;
- `/v1/run_tests` with many cases forks every case from one zygote (through one runner);
- a run is one process: PID 1 of its namespace, the zygote's own child (no runner in between);
- idle runners are topped up when a run ends, at once only when fewer than half are idle;
- the zygote is replaced after `fork_server_max_forks` forks and when it dies, and the mode is
  reported in the status (warm spawn when the fork server is off);
- closing the backend leaves no runner behind, not even one waiting to be reaped.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandboxd.models import ExecResult, Limits, RunSpec
from sandboxd.process import ProcessBackend
from sandboxd.service import SandboxService
from sandboxd.settings import SandboxSettings
from sandboxd.wire import RunTestsRequest
from sandboxd.wire import TestCase as Case
from toolenv_core.deadline import Deadline

pytestmark = pytest.mark.bwrap

CORPUS = sorted(Path(__file__).with_name("fork_corpus").glob("*.py"))
STDIN = "first line\nthe rest\n"


def settings(**kw: object) -> SandboxSettings:
    return SandboxSettings(max_concurrency=2, **kw)


async def started(**kw: object) -> ProcessBackend:
    backend = ProcessBackend(settings(**kw))
    await backend.start()
    return backend


@pytest.fixture
async def forking(bwrap_path: str) -> AsyncIterator[ProcessBackend]:
    backend = await started()
    assert backend.status()["python_mode"] == "fork_server", backend.status()["fork_server"]
    yield backend
    await backend.close()


async def run(backend: ProcessBackend, code: str, **limits: object) -> ExecResult:
    spec = RunSpec(
        language="python",
        code=code,
        stdin=STDIN,
        run_limits=Limits(**{"wall_time_s": 2.0, "memory_mb": 256, **limits}),
    )
    result = await backend.run(spec, Deadline.after(30))
    assert result.run is not None, result
    return result.run


def observable(e: ExecResult) -> tuple[object, ...]:
    return (e.status, e.exit_code, e.signal, e.stdout, e.stderr, e.stdout_truncated, e.message)


async def run_corpus(**kw: object) -> tuple[str, dict[str, tuple[object, ...]]]:
    """Every corpus program on one backend (one at a time: two backends in one process would
    share their cgroup and run-dir names)."""
    backend = await started(**kw)
    try:
        mode = backend.status()["python_mode"]
        results = {p.name: observable(await run(backend, p.read_bytes().decode())) for p in CORPUS}
        if backend.fork_server is not None:
            assert backend.fork_server.status()["forks"] >= len(CORPUS)
        return mode, results
    finally:
        await backend.close()


async def test_every_corpus_program_behaves_as_in_a_fresh_interpreter(bwrap_path: str) -> None:
    fork_mode, forked = await run_corpus()
    spawn_mode, spawned = await run_corpus(fork_server=False)
    assert (fork_mode, spawn_mode) == ("fork_server", "warm_spawn")
    assert len(forked) == len(CORPUS) >= 30
    differences = [
        f"{name}:\n  fork:  {forked[name]}\n  spawn: {spawned[name]}"
        for name in forked
        if forked[name] != spawned[name]
    ]
    assert not differences, "\n".join(differences)


async def test_in_a_user_namespace_too(bwrap_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mode a service without CAP_SYS_ADMIN and CAP_CHOWN takes (a compose container): the
    zygote in a user namespace of its own. Chosen here for a root service, whose runs then go
    the same way; the corpus still matches the warm-spawn path."""
    monkeypatch.setattr("sandboxd.process.forkserver.needs_user_namespace", lambda: True)
    backend = await started()
    try:
        status = backend.status()["fork_server"]
        assert status["available"] and status["user_namespace"], status
        me = await run(backend, IDENTITY)
    finally:
        await backend.close()
    zero = "0000000000000000"
    assert me.stdout.splitlines() == [f"65534 65534 {zero} {zero} {zero} 1", "65534 ['ptmx']"]
    fork_mode, forked = await run_corpus()
    _, spawned = await run_corpus(fork_server=False)
    assert fork_mode == "fork_server"
    assert {n: r for n, r in forked.items() if r != spawned[n]} == {}


IDENTITY = """import os
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
caps = (status[k].strip() for k in ("CapEff", "CapPrm", "CapAmb", "NoNewPrivs"))
print(os.getuid(), os.getgid(), *caps)
print(os.stat("main.py").st_uid, os.listdir("/dev/pts"))
"""

POLLUTER = """
import builtins, json, os, subprocess, sys, threading, time
builtins.len = lambda x: 42
builtins.polluted = True
json.dumps = None
sys.modules["planted"] = sys
os.environ["PLANTED"] = "1"
for d in ("/tmp", "/dev/shm", "/sandbox"):
    open(os.path.join(d, "planted"), "w").write("x")
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
subprocess.Popen(["/usr/bin/sleep", "30"], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    time.sleep(30)
print("polluted", flush=True)
"""

CHECKER = """
import builtins, json, os, sys, threading
print(len("abc"), hasattr(builtins, "polluted"), json.dumps([1]), "planted" in sys.modules)
print(os.environ.get("PLANTED"), sorted(os.listdir("/tmp")), sorted(os.listdir("/dev/shm")))
print(sorted(os.listdir(".")), threading.active_count())
print(sorted(p for p in os.listdir("/proc") if p.isdigit()))
"""


async def test_nothing_of_one_run_is_visible_to_the_next(forking) -> None:
    polluted = await run(forking, POLLUTER)
    assert polluted.stdout == "polluted\n", polluted
    for _ in range(3):  # whichever pre-forked runner takes it
        clean = await run(forking, CHECKER)
        assert clean.stdout.splitlines() == [
            "3 False [1] False",
            "None [] []",
            "['main.py'] 1",
            "['1']",
        ], clean


STDIN_REWRITE = """
import sys
for mode in ("w", "a", "r+"):
    try:
        with open("/proc/self/fd/0", mode) as f:
            f.write("rewritten")
        print(mode, "written")
    except OSError as exc:
        print(mode, type(exc).__name__)
data = sys.stdin.read()
print(len(data), data.endswith("end\\n"))
"""


async def test_stdin_is_a_sealed_file_of_any_size(forking) -> None:
    """A run's stdin (a sealed memfd) is read whole, and not even the program can rewrite it
    through /proc/self/fd/0."""
    big = "x" * (3 << 20) + "end\n"
    spec = RunSpec(language="python", code=STDIN_REWRITE, stdin=big)
    result = await forking.run(spec, Deadline.after(30))
    assert result.run is not None and result.run.exit_code == 0, result
    assert result.run.stdout.splitlines() == [
        "w PermissionError",
        "a PermissionError",
        "r+ PermissionError",
        f"{len(big)} True",
    ], result.run


@pytest.mark.parametrize("batch", [True, False], ids=["one-runner", "runner-per-case"])
async def test_run_tests_forks_every_case_from_one_zygote(bwrap_path: str, batch: bool) -> None:
    """With batches on (the default) the request takes one fork of the zygote (its runner
    forks the cases); off, one fork per case."""
    service = SandboxService(settings(fork_server_batch=batch))
    await service.start()
    try:
        before = service.status()["fork_server"]
        req = RunTestsRequest(
            code="n = int(input())\nprint(n * n)\n",
            language="python",
            cases=[Case(stdin=f"{i}\n", expected_stdout=f"{i * i}\n") for i in range(60)],
        )
        response = await service.run_tests(req, Deadline.after(120))
        after = service.status()["fork_server"]
    finally:
        await service.close()
    assert response.passed == 60, response
    assert after["forks"] - before["forks"] == (1 if batch else 60)
    assert after["zygotes_started"] == before["zygotes_started"] == 1


async def test_a_run_is_one_process_cloned_by_the_zygote(forking) -> None:
    zygote = forking.fork_server.current
    assert zygote is not None
    for _ in range(100):  # the idle runners are cloned in the background
        if zygote.idle and all(r.pid for r in zygote.idle.values()):
            break
        await asyncio.sleep(0.05)
    zygote_pid = int(Path(f"/proc/{zygote.proc.pid}/task/{zygote.proc.pid}/children").read_text())
    for runner in zygote.idle.values():  # each waits alone: no program forked under it
        assert Path(f"/proc/{runner.pid}/task/{runner.pid}/children").read_text().split() == []
        assert f"PPid:\t{zygote_pid}\n" in Path(f"/proc/{runner.pid}/status").read_text()
    r = await run(forking, "import os\nprint(os.getpid(), os.getppid())\n")
    assert r.stdout == "1 0\n", r  # PID 1, its parent (the zygote) outside its namespace


async def test_idle_runners_are_topped_up_as_runs_end_unless_few_are_left(forking) -> None:
    """No runner is cloned beside a starting run while at least half are idle (it would take
    the run's CPU); the pool is topped up when the run ends, or at once when few are left."""
    server = forking.fork_server
    zygote = server.current
    assert zygote is not None and server.prefork == 2
    sleeper = "import time\ntime.sleep(0.6)\nprint('done')\n"
    one = asyncio.create_task(run(forking, sleeper))
    await asyncio.sleep(0.3)
    assert len(zygote.idle) == server.prefork - 1
    assert (await one).stdout == "done\n"
    assert len(zygote.idle) == server.prefork
    both = [asyncio.create_task(run(forking, sleeper)) for _ in range(server.prefork)]
    await asyncio.sleep(0.3)
    assert len(zygote.idle) == server.prefork  # none was left idle: topped up at once
    assert [r.stdout for r in await asyncio.gather(*both)] == ["done\n"] * server.prefork


async def test_closing_reaps_every_runner_before_it_returns(bwrap_path: str) -> None:
    """The zygote reaps the runners it kills: an orphan would wait for the host's init to reap
    it, holding its cgroup slot meanwhile (the service's stop waited about 1.8 s for that)."""
    backend = await started()
    zygote = backend.fork_server.current
    assert zygote is not None
    for _ in range(100):
        if len(zygote.idle) == backend.fork_server.prefork and all(
            r.pid for r in zygote.idle.values()
        ):
            break
        await asyncio.sleep(0.05)
    pids = [r.pid for r in zygote.idle.values()]
    assert len(pids) == backend.fork_server.prefork
    try:
        backend.fork_server.close()  # returns once the zygote's bwrap has exited
        left = [p for p in pids if Path(f"/proc/{p}").exists()]
    finally:
        await backend.close()
    assert left == []  # not even a zombie


async def test_zygote_is_replaced_after_max_forks(bwrap_path: str) -> None:
    backend = await started(fork_server_max_forks=3)
    try:
        outputs = [(await run(backend, f"print({i})")).stdout for i in range(8)]
        status = backend.status()["fork_server"]
    finally:
        await backend.close()
    assert outputs == [f"{i}\n" for i in range(8)]
    assert status["zygotes_started"] == 3 and status["anomalies"] == 0


async def test_a_dead_zygote_is_an_anomaly_and_is_replaced(forking) -> None:
    zygote = forking.fork_server.current
    assert zygote is not None
    os.kill(zygote.proc.pid, signal.SIGKILL)
    for _ in range(100):
        if not zygote.alive:
            break
        await asyncio.sleep(0.05)
    assert not zygote.alive
    after = await run(forking, "print('still here')")
    status = forking.status()["fork_server"]
    assert after.stdout == "still here\n"
    assert status["anomalies"] == 1 and status["zygotes_started"] == 2
    assert zygote.proc.poll() is not None  # the dead one was reaped


async def test_a_dead_zygote_is_counted_and_replaced_before_the_next_run(forking) -> None:
    """Replaced at once, not by the next python run: until then the status said no anomaly and
    counted the dead runners as idle, the zygote's bwrap stayed a zombie, and that run paid for
    a new zygote."""
    server = forking.fork_server
    zygote = server.current
    assert zygote is not None
    os.kill(zygote.proc.pid, signal.SIGKILL)
    for _ in range(100):
        if server.current is not zygote and len(server.current.idle) == server.prefork:
            break
        await asyncio.sleep(0.05)
    status = forking.status()["fork_server"]
    assert status["anomalies"] == 1 and status["last_anomaly"] == "the zygote exited", status
    assert status["zygotes_started"] == 2 and status["idle_runners"] == server.prefork
    assert status["zygote_pid"] == server.current.proc.pid != zygote.proc.pid
    assert zygote.proc.poll() is not None  # reaped
    assert (await run(forking, "print('still here')")).stdout == "still here\n"
    assert forking.status()["fork_server"]["zygotes_started"] == 2


async def test_fork_server_off_means_warm_spawn(bwrap_path: str) -> None:
    backend = await started(fork_server=False)
    try:
        status = backend.status()
        for _ in range(200):  # the warm pool fills in the background
            if backend.status()["warm"].get("/usr/bin/python3 main.py") == status["warm_target"]:
                break
            await asyncio.sleep(0.05)
        r = await run(backend, "print('spawned')")
        hits = backend.status()["warm_hits"]
    finally:
        await backend.close()
    assert status["python_mode"] == "warm_spawn" and status["fork_server"] is None
    assert r.stdout == "spawned\n" and hits == 1


async def test_runs_cancelled_as_they_start_are_no_anomaly(forking) -> None:
    """Callers that hang up as their runs start (a runner cloned a moment before, whose pid is
    still awaited from the zygote): the runner had the request, its dir was removed under it,
    its set-up failed, and each such failure was an anomaly that replaced the zygote (about
    one round in four here; 23 of 400 quick hang-ups through the gateway)."""
    rng = random.Random(7)
    for _ in range(60):
        runs = [asyncio.create_task(run(forking, "print(1)")) for _ in range(4)]
        await asyncio.sleep(rng.uniform(0.001, 0.03))
        for task in runs:
            task.cancel()
        await asyncio.gather(*runs, return_exceptions=True)
    after = await run(forking, "print('still here')")
    status = forking.status()["fork_server"]
    assert after.stdout == "still here\n"
    assert (status["anomalies"], status["last_anomaly"]) == (0, None)
    assert status["zygotes_started"] == 1
