"""Hostile programs against the docker backend, with real dockerd containers.

The pool holds ONE container, so the probe that follows each hostile run lands in the same
container (asserted by its sandbox id) unless the backend replaced it on purpose. The probe
lists, from inside, every process, the writable places, System V IPC objects and its own
environment: nothing of the hostile run may be left.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest
from anyio.from_thread import BlockingPortal
from docker_support import assert_clean_after, build_sandbox_image

from sandboxd.docker_backend import DockerBackend
from sandboxd.docker_backend.container import SandboxContainer
from sandboxd.models import ExecStatus, Limits, RunResult, RunSpec
from sandboxd.settings import SandboxSettings
from toolenv_core.deadline import Deadline

pytestmark = pytest.mark.docker
REPO = Path(__file__).resolve().parents[2]
SECRET = "toolenv-driver-secret-0451"


@pytest.fixture(scope="module")
def backend(portal: BlockingPortal, base_image: str) -> Iterator[DockerBackend]:
    image = build_sandbox_image(base_image)
    os.environ[SECRET] = SECRET  # the driver's environment must never reach a program
    settings = SandboxSettings(docker_image=image, docker_pool_size=1, docker_memory_mb=768)
    b = DockerBackend(settings)
    portal.call(b.start)
    try:
        yield b
    finally:
        portal.call(b.close)
        os.environ.pop(SECRET, None)
        pool_id = b.pool.pool_id if b.pool else "none"
        left = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label=toolenv.pool={pool_id}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        assert left == [], f"containers left after close: {left}"
        if b.pool is not None:  # and no socket dir or lock file on the host
            assert not b.pool.dir.exists() and not b.pool.lock_path.exists()


def run(
    portal: BlockingPortal,
    backend: DockerBackend,
    code: str,
    language: str = "python",
    deadline_s: float = 30.0,
    **limits: object,
) -> RunResult:
    spec = RunSpec(
        language=language, code=code, run_limits=Limits(**{"wall_time_s": 3.0, **limits})
    )
    started = time.monotonic()
    result = portal.call(backend.run, spec, Deadline.after(deadline_s))
    assert time.monotonic() - started < deadline_s + 0.5, "the run outlived its deadline"
    return result


def test_infinite_loop_is_a_time_limit(portal, backend) -> None:
    started = time.monotonic()
    r = run(portal, backend, "print('spinning', flush=True)\nwhile True: pass", wall_time_s=1.0)
    assert r.run.status == ExecStatus.TIME_LIMIT
    assert r.run.stdout == "spinning\n"  # partial output kept
    assert time.monotonic() - started < 4.0
    assert_clean_after(portal, backend, r)


def test_sleep_ignoring_sigterm_is_killed(portal, backend) -> None:
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)"
    r = run(portal, backend, code, wall_time_s=1.0)
    assert r.run.status == ExecStatus.TIME_LIMIT and r.run.signal == 9
    assert_clean_after(portal, backend, r)


def test_request_deadline_bounds_the_run(portal, backend) -> None:
    started = time.monotonic()
    r = run(portal, backend, "import time\ntime.sleep(60)", deadline_s=1.5, wall_time_s=30.0)
    assert time.monotonic() - started < 2.0
    assert r.run.status == ExecStatus.TIME_LIMIT
    assert_clean_after(portal, backend, r)


def test_fork_bomb(portal, backend) -> None:
    r = run(portal, backend, ":(){ :|:& };:\n:", language="bash", wall_time_s=2.0)
    assert r.run is not None  # whatever it did, it ended and the container came back clean
    assert_clean_after(portal, backend, r)


def test_memory_bomb_within_rlimit(portal, backend) -> None:
    code = "x = []\nwhile True: x.append(bytearray(32 << 20))"
    r = run(portal, backend, code, memory_mb=256)
    assert r.run.status == ExecStatus.MEMORY_LIMIT, r.run
    assert_clean_after(portal, backend, r)


def test_forked_memory_bomb_hits_the_container_limit(portal, backend) -> None:
    """Processes each under the address-space limit, together over the container's memory."""
    code = (
        "import os, time\n"
        "for _ in range(3): os.fork()\n"  # 8 processes x 200 MB > 768 MB container limit
        "x = bytearray(200 << 20)\n"
        "for i in range(0, len(x), 4096): x[i] = 1\n"
        "time.sleep(1)\n"
    )
    r = run(portal, backend, code, memory_mb=256, wall_time_s=8.0)
    assert r.run.status == ExecStatus.MEMORY_LIMIT, r.run
    # a cgroup OOM kill is an anomaly: that container is replaced, the next run is still clean
    assert_clean_after(portal, backend, r, same=False)


def test_gigabyte_of_stdout_is_capped(portal, backend) -> None:
    code = "import sys\nb = b'x' * (1 << 20)\nfor _ in range(1024): sys.stdout.buffer.write(b)"
    started = time.monotonic()
    r = run(portal, backend, code, max_output_bytes=65536)
    assert r.run.status == ExecStatus.OUTPUT_LIMIT
    assert r.run.stdout_truncated and len(r.run.stdout) == 65536
    assert time.monotonic() - started < 3.0
    # which stream, in the process backend's words (it said "output limit of 65536 bytes")
    assert r.run.message == "stdout exceeded 65536 bytes; the program was killed"
    assert_clean_after(portal, backend, r)
    r = run(portal, backend, code.replace("stdout", "stderr"), max_output_bytes=65536)
    assert r.run.status == ExecStatus.OUTPUT_LIMIT and r.run.stderr_truncated
    assert r.run.message == "stderr exceeded 65536 bytes; the program was killed"


def test_filling_the_disk(portal, backend) -> None:
    code = (
        "import os\n"
        "out = {}\n"
        "for d in ('/sandbox', '/tmp', '/dev/shm'):\n"
        "    n = 0\n"
        "    try:\n"
        "        with open(d + '/fill', 'wb') as f:\n"
        "            while True:\n"
        "                f.write(b'x' * (1 << 20)); f.flush(); n += 1\n"
        "    except OSError as e:\n"
        "        out[d] = [n, e.errno]\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        open(f'/tmp/{n}', 'w').close(); n += 1\n"
        "except OSError as e:\n"
        "    out['inodes'] = [n, e.errno]\n"
        "print(out)\n"
    )
    r = run(portal, backend, code, max_file_size_mb=512, memory_mb=512, wall_time_s=10.0)
    assert r.run.status == ExecStatus.FINISHED, r.run
    out = eval(r.run.stdout)  # noqa: S307 - our own program printed a dict literal
    assert {d: e[1] for d, e in out.items()} == dict.fromkeys(out, 28)  # ENOSPC everywhere
    assert set(out) == {"/sandbox", "/tmp", "/dev/shm", "inodes"}
    assert out["/sandbox"][0] <= 64 and out["inodes"][0] < 16384  # bounded by the tmpfs sizes
    assert_clean_after(portal, backend, r)


def test_dev_shm_holds_no_flood_of_files(portal, backend) -> None:
    """/dev/shm has the inode bound of /sandbox and /tmp: Docker's own (shm_size) had none, and
    a program made a million empty files there in 6 s, which the reset took 5.5 s to delete."""
    code = (
        "import os\n"
        "n = errno = 0\n"
        "try:\n"
        "    for n in range(20000):\n"
        "        os.close(os.open(f'/dev/shm/{n}', os.O_CREAT | os.O_WRONLY))\n"
        "except OSError as e:\n"
        "    errno = e.errno\n"
        "print(n, errno)\n"
    )
    r = run(portal, backend, code)
    assert r.run.status == ExecStatus.FINISHED, r.run
    made, errno = map(int, r.run.stdout.split())
    assert made < 16384 and errno == 28, r.run.stdout  # ENOSPC at the tmpfs's inode bound
    assert_clean_after(portal, backend, r)


def test_a_tree_3000_deep_is_removed_by_the_reset(portal, backend) -> None:
    """shutil.rmtree recurses once per level: the reset raised RecursionError on these trees
    and the agent (PID 1) died with it, so each such run cost the pool its container."""
    code = (
        "import os\n"
        "for top in ('/sandbox', '/tmp', '/dev/shm'):\n"
        "    os.chdir(top)\n"
        "    for _ in range(3000):\n"
        "        os.mkdir('d'); os.chdir('d')\n"
        "print('deep')\n"
    )
    r = run(portal, backend, code)
    assert r.run.status == ExecStatus.FINISHED and r.run.stdout == "deep\n", r.run
    assert_clean_after(portal, backend, r)


def test_no_network(portal, backend) -> None:
    accepted = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        port = server.getsockname()[1]
        stop = threading.Event()

        def accept() -> None:
            while not stop.is_set():
                try:
                    accepted.append(server.accept())
                except OSError:
                    pass

        t = threading.Thread(target=accept)
        t.start()
        code = (
            "import socket\n"
            "out = {}\n"
            "try:\n    socket.getaddrinfo('example.com', 80); out['dns'] = 'resolved'\n"
            "except OSError as e:\n    out['dns'] = repr(e)\n"
            f"for host in ('127.0.0.1', '172.17.0.1'):\n"
            "    s = socket.socket(); s.settimeout(1)\n"
            f"    try:\n        s.connect((host, {port})); out[host] = 'connected'\n"
            "    except OSError as e:\n        out[host] = repr(e)\n"
            "print(out)\n"
        )
        try:
            r = run(portal, backend, code)
        finally:
            stop.set()
            t.join()
    assert r.run.status == ExecStatus.FINISHED
    assert "resolved" not in r.run.stdout and "connected" not in r.run.stdout, r.run.stdout
    assert accepted == []
    assert_clean_after(portal, backend, r)


def test_no_secrets(portal, backend) -> None:
    code = (
        "import os\n"
        "out = {}\n"
        "for path in ('/etc/shadow', '/proc/1/environ', '/run/toolenv/agent.sock', '/proc/1/root/etc'):\n"
        "    try:\n        open(path).read(); out[path] = 'read'\n"
        "    except OSError as e:\n        out[path] = type(e).__name__\n"
        "blob = ''\n"
        "for p in os.listdir('/proc'):\n"
        "    try:\n        blob += open(f'/proc/{p}/environ').read()\n"
        "    except OSError:\n        pass\n"
        f"out['secret_seen'] = {SECRET!r} in blob or {SECRET!r} in str(os.environ)\n"
        "st = open('/proc/self/status').read()\n"
        "out['caps'] = [l.split()[1] for l in st.splitlines() if l.startswith(('CapEff', 'CapPrm'))]\n"
        "out['nnp'] = [l.split()[1] for l in st.splitlines() if l.startswith('NoNewPrivs')]\n"
        "out['fds'] = sorted(os.listdir('/proc/self/fd'))\n"
        "print(out)\n"
    )
    r = run(portal, backend, code)
    out = eval(r.run.stdout)  # noqa: S307 - our own program printed a dict literal
    assert out["/etc/shadow"] == "PermissionError"
    assert out["/proc/1/environ"] == "PermissionError"
    assert out["/run/toolenv/agent.sock"] == "PermissionError"
    assert out["/proc/1/root/etc"] == "PermissionError"
    assert out["secret_seen"] is False
    assert out["caps"] == ["0000000000000000", "0000000000000000"]
    assert out["nnp"] == ["1"]
    assert out["fds"] == ["0", "1", "2", "3"]  # 3 is the listing itself: no agent fd leaked
    assert_clean_after(portal, backend, r)


def test_a_closed_connection_does_not_hold_its_port_for_the_next_run(portal, backend) -> None:
    """Runs share the container's network namespace: a connection the previous run closed
    first sat in TIME_WAIT, and the next run got EADDRINUSE binding that port for 60 s (on the
    process backend each run has a namespace of its own)."""
    code = (
        "import socket\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 7777)); s.listen()\n"
        "c = socket.create_connection(('127.0.0.1', 7777)); a, _ = s.accept()\n"
        "a.close(); c.recv(1); c.close(); s.close()\n"
        "print('served')\n"
    )
    first = run(portal, backend, code)
    assert first.run.status == ExecStatus.FINISHED and first.run.stdout == "served\n", first.run
    again = run(portal, backend, code)
    assert again.sandbox_id == first.sandbox_id, "expected the same container to be reused"
    assert again.run.status == ExecStatus.FINISHED and again.run.stdout == "served\n", again.run
    assert_clean_after(portal, backend, again)


def test_writing_outside_the_workdir(portal, backend) -> None:
    code = (
        "out = {}\n"
        "for path in ('/etc/passwd', '/usr/bin/x', '/opt/toolenv/agent.py', '/run/toolenv/x', '/x'):\n"
        "    try:\n        open(path, 'a').write('x'); out[path] = 'written'\n"
        "    except OSError as e:\n        out[path] = type(e).__name__\n"
        "print(out)\n"
    )
    r = run(portal, backend, code)
    assert r.run.status == ExecStatus.FINISHED
    assert "written" not in r.run.stdout, r.run.stdout
    assert_clean_after(portal, backend, r)


def test_daemon_does_not_outlive_its_run(portal, backend) -> None:
    code = (
        "import os, time, sys\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        for i in range(6000):\n"
        "            open('/tmp/daemon-alive', 'w').write(str(i)); time.sleep(0.01)\n"
        "    os._exit(0)\n"
        "time.sleep(0.2)\n"
        "print('parent done', os.path.exists('/tmp/daemon-alive'))\n"
    )
    r = run(portal, backend, code)
    assert r.run.status == ExecStatus.FINISHED and "parent done True" in r.run.stdout
    assert_clean_after(portal, backend, r)


def test_a_program_compiled_once_leaves_nothing_between_its_runs(portal, backend) -> None:
    """run_tests compiles once and sends the binary to every case: the compile's container and
    each case's are reset like any run's (a daemon, files in /tmp and the workdir)."""
    code = (
        "#include <stdio.h>\n#include <unistd.h>\n"
        'int main(){ int seen = access("/tmp/alive", F_OK) == 0 || access("out", F_OK) == 0;\n'
        '  fclose(fopen("out", "w"));\n'
        '  if (fork() == 0) { setsid(); if (fork() == 0) { for (;;) { fclose(fopen("/tmp/alive", "w")); usleep(10000); } } _exit(0); }\n'
        '  usleep(200000); printf("%s %d\\n", seen ? "dirty" : "fresh", access("/tmp/alive", F_OK));\n}\n'
    )
    spec = RunSpec(language="c", code=code, compile_limits=Limits(wall_time_s=30.0))
    compiled, artifact = portal.call(backend.compile, spec, Deadline.after(60))
    assert compiled.status == ExecStatus.FINISHED and compiled.exit_code == 0, compiled
    assert artifact is not None and artifact.startswith(b"\x7fELF")
    spec = spec.model_copy(update={"prebuilt": artifact})
    for _ in range(2):
        r = portal.call(backend.run, spec, Deadline.after(30))
        assert r.compile is None  # nothing compiled where it ran
        assert r.run.status == ExecStatus.FINISHED and r.run.stdout == "fresh 0\n", r.run
    assert_clean_after(portal, backend, r)


def test_killing_its_parent_and_the_agent(portal, backend) -> None:
    code = (
        "import os, signal\n"
        "out = {}\n"
        "for name, pid in (('parent', os.getppid()), ('agent', 1)):\n"
        "    try:\n        os.kill(pid, signal.SIGKILL); out[name] = 'killed'\n"
        "    except OSError as e:\n        out[name] = type(e).__name__\n"
        "print(out, flush=True)\n"
        "if os.fork() == 0:\n    os.execv('/bin/sleep', ['sleep', '60'])\n"
        "os.kill(-1, signal.SIGKILL)\n"  # everything it may signal: only its own child
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    r = run(portal, backend, code)
    assert (
        "'parent': 'PermissionError'" in r.run.stdout
        and "'agent': 'PermissionError'" in r.run.stdout
    )
    assert r.run.signal == 9
    assert_clean_after(portal, backend, r)


def test_sysv_ipc_and_files_do_not_leak(portal, backend) -> None:
    code = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None)\n"
        "print(libc.shmget(0x5eed, 4096, 0o1666), libc.msgget(0x5eed, 0o1666))\n"
        "os.makedirs('/sandbox/d/e', exist_ok=True); open('/sandbox/d/e/f', 'w').write('x')\n"
        "os.chmod('/sandbox/d/e', 0); os.chmod('/sandbox/d', 0)\n"
        "os.symlink('/etc/shadow', '/tmp/link'); open('/dev/shm/x', 'w').write('x')\n"
        "os.chmod('/sandbox', 0o777)\n"
    )
    r = run(portal, backend, code)
    assert r.run.status == ExecStatus.FINISHED and r.run.exit_code == 0, r.run
    assert "-1" not in r.run.stdout
    assert_clean_after(portal, backend, r)


def freeze_the_idle_container(
    backend: DockerBackend,
) -> tuple[docker.DockerClient, SandboxContainer]:
    """`docker pause` the pool's one container once it is idle: its agent can answer nothing."""
    client = docker.from_env()
    pool = backend.pool
    assert pool is not None
    busy_wait = time.monotonic() + 10
    while pool.status()["idle"] < 1 and time.monotonic() < busy_wait:
        time.sleep(0.05)
    (victim,) = list(pool._live.values())
    client.containers.get(victim.id).pause()
    return client, victim


def test_unresponsive_agent_is_replaced_at_the_deadline(portal, backend) -> None:
    """The host-side deadline: a frozen container (docker pause) cannot hold a run past it."""
    client, victim = freeze_the_idle_container(backend)
    started = time.monotonic()
    r = run(portal, backend, "print(1)", deadline_s=1.5)
    assert time.monotonic() - started < 2.0
    assert r.run.status == ExecStatus.TIME_LIMIT and "destroyed" in r.run.message
    assert r.sandbox_id == victim.name
    gone_by = time.monotonic() + 20
    while time.monotonic() < gone_by:
        if not client.api.containers(all=True, filters={"id": victim.id}):
            break
        time.sleep(0.1)
    else:
        pytest.fail("the frozen container was not removed")
    assert_clean_after(portal, backend, r, same=False)


@pytest.mark.parametrize("deadline_s", [None, 20.0], ids=["no-deadline", "long-deadline"])
def test_a_frozen_agent_is_a_sandbox_error_soon_after_its_limits(
    portal, backend, deadline_s: float | None
) -> None:
    """A frozen container is the sandbox's failure, not the program's time limit: answered a
    few seconds past the run's own limits (not at a far deadline: it waited all of it), and not
    as a TimeLimitExceeded "deadline reached" (it said so for a call with no deadline)."""
    _, victim = freeze_the_idle_container(backend)
    spec = RunSpec(language="python", code="print(1)", run_limits=Limits(wall_time_s=1.0))
    deadline = Deadline.never() if deadline_s is None else Deadline.after(deadline_s)
    started = time.monotonic()
    r = portal.call(backend.run, spec, deadline)
    took = time.monotonic() - started
    assert r.run is not None and r.run.status == ExecStatus.ERROR, r.run
    assert "did not answer within 8 s" in r.run.message and "destroyed" in r.run.message
    assert 7.5 < took < 10.0, took
    assert r.sandbox_id == victim.name
    assert_clean_after(portal, backend, r, same=False)
