"""Hostile programs against the process backend, through a real `toolenv sandboxd serve`.

After every case: the service still answers, the next run is clean (fresh working dir, alone in
its PID namespace), and nothing is left behind: no process, cgroup task, run dir, mount, fd or
orphaned zombie (see `LeakProbe` in conftest.py).
"""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from sbx_support import SECRET, SandboxdServer, start_sandboxd

pytestmark = pytest.mark.bwrap

CLEAN_CHECK = """
import os
print(sorted(os.listdir('.')))
print(sorted(p for p in os.listdir('/proc') if p.isdigit()))
"""


def check_still_clean(server: SandboxdServer) -> None:
    assert server.client.get("/v1/ping").json() == "pong"
    after = server.run_code(code=CLEAN_CHECK, language="python")
    assert after["status"] == "Success", after
    files, pids = after["run_result"]["stdout"].splitlines()
    assert files == "['main.py']"  # a fresh working dir: nothing from the previous run
    assert pids == "['1']"  # alone in its PID namespace: no survivor of the previous run
    server.probe.assert_clean()


def run(server: SandboxdServer, code: str, **kw: object) -> tuple[dict, float]:
    started = time.monotonic()
    result = server.run_code(code=code, language=kw.pop("language", "python"), **kw)
    return result, time.monotonic() - started


def test_python_here_forks_from_the_fork_server(sandboxd: SandboxdServer) -> None:
    """Every python case of this suite runs on the fork server (its default)."""
    status = sandboxd.client.get("/v1/sandbox/status").json()
    assert status["python_mode"] == "fork_server", status["fork_server"]


def test_infinite_loop_is_killed_at_the_run_timeout(sandboxd: SandboxdServer) -> None:
    res, elapsed = run(sandboxd, "while True: pass", run_timeout=1)
    assert res["status"] == "Failed"
    assert res["run_result"]["status"] == "TimeLimitExceeded"
    assert elapsed < 6
    check_still_clean(sandboxd)


def test_sleep_ignoring_sigterm_is_killed_with_partial_output(sandboxd: SandboxdServer) -> None:
    code = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('started', flush=True)\n"
        "time.sleep(600)\n"
    )
    res, elapsed = run(sandboxd, code, run_timeout=1)
    assert res["run_result"]["status"] == "TimeLimitExceeded"
    assert res["run_result"]["stdout"] == "started\n"
    assert elapsed < 6
    check_still_clean(sandboxd)


@pytest.mark.parametrize(
    "language,code",
    [
        (
            "python",
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        ),
        ("bash", "f() { f | f & }; f; sleep 30"),
    ],
)
def test_fork_bomb_is_bounded_and_reaped(
    sandboxd: SandboxdServer, language: str, code: str
) -> None:
    res, elapsed = run(sandboxd, code, language=language, run_timeout=2)
    assert res["run_result"]["status"] == "TimeLimitExceeded", res["run_result"]
    assert elapsed < 10
    check_still_clean(sandboxd)


def test_memory_bomb_is_memory_limit_exceeded(sandboxd: SandboxdServer) -> None:
    code = "a = []\nwhile True:\n    a.append(bytearray(16 * 2**20))\n"
    res, _ = run(sandboxd, code, run_timeout=10, memory_limit_MB=128)
    assert res["status"] == "Failed"
    assert res["run_result"]["limit"] == "memory", res["run_result"]
    assert res["run_result"]["peak_memory_kb"] <= 128 * 1024
    check_still_clean(sandboxd)


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_one_gigabyte_flood_is_cut_at_the_cap(sandboxd: SandboxdServer, stream: str) -> None:
    code = (
        "import sys\n"
        "chunk = b'x' * (1 << 20)\n"
        f"for _ in range(1024): sys.{stream}.buffer.write(chunk)\n"
    )
    res, elapsed = run(sandboxd, code, run_timeout=20, max_output_bytes=65536)
    rr = res["run_result"]
    assert rr["limit"] == "output"
    assert rr[f"{stream}_truncated"] is True and rr["truncated"] is True
    assert len(rr[stream]) == 65536
    assert elapsed < 10  # killed at the cap, not after writing 1 GB
    check_still_clean(sandboxd)


def test_filling_the_disk_stops_at_the_limits(sandboxd: SandboxdServer) -> None:
    free_before = Path("/dev/shm").stat()  # noqa: F841 (keeps the intent readable)
    code = (
        "i = 0\n"
        "try:\n"
        "    while True:\n"
        "        with open(f'fill{i}', 'wb') as f:\n"
        "            for _ in range(48): f.write(b'\\0' * (1 << 20))\n"
        "        i += 1\n"
        "except OSError as e:\n"
        "    print('stopped after', i, 'files:', e.strerror, flush=True)\n"
        "    raise SystemExit(1)\n"
    )
    res, elapsed = run(sandboxd, code, run_timeout=20, memory_limit_MB=160)
    assert res["status"] == "Failed"
    assert res["run_result"]["status"] == "Finished", res["run_result"]
    assert elapsed < 20
    # a single file larger than the file-size limit fails too
    res, _ = run(sandboxd, "open('big','wb').write(b'\\0' * (100 << 20))", memory_limit_MB=512)
    assert res["status"] == "Failed"
    assert "File too large" in res["run_result"]["stderr"] or res["run_result"]["return_code"]
    check_still_clean(sandboxd)


@pytest.mark.parametrize("language", ["python", "bash"])
def test_dirs_nested_deeper_than_pythons_recursion_are_removed(
    sandboxd: SandboxdServer, language: str
) -> None:
    """Before: rmtree's RecursionError was the answer (`SandboxError`), and the run dir and its
    cgroup slot were never freed."""
    code = {
        "python": "import os\nfor _ in range(3000):\n    os.mkdir('d'); os.chdir('d')\nprint('deep')",
        "bash": 'cd /tmp && cd /sandbox && python3 -c "import os\nfor _ in range(3000):\n'
        "    os.mkdir('d'); os.chdir('d')\" && echo deep",
    }[language]
    res, _ = run(sandboxd, code, language=language, run_timeout=20)
    assert res["status"] == "Success", res
    assert res["run_result"]["stdout"] == "deep\n"
    check_still_clean(sandboxd)


def test_removing_half_a_million_files_does_not_stall_the_service(
    sandboxd: SandboxdServer,
) -> None:
    """Before: the run dir was removed on the event loop (seconds for this one), and the
    service answered no one meanwhile, not even `/v1/ping`."""
    stalls: list[float] = []
    done = threading.Event()

    def ping() -> None:
        with httpx.Client(base_url=sandboxd.url, timeout=30) as client:
            while not done.is_set():
                started = time.monotonic()
                client.get("/v1/ping")
                stalls.append(time.monotonic() - started)
                time.sleep(0.02)

    pinger = threading.Thread(target=ping)
    pinger.start()
    try:
        code = "for i in range(500_000): open(f'f{i}', 'w').close()\nprint('made')"
        res, _ = run(sandboxd, code, run_timeout=30, memory_limit_MB=2048)
    finally:
        done.set()
        pinger.join()
    assert res["status"] == "Success", res
    assert max(stalls) < 1.0, sorted(stalls)[-5:]
    check_still_clean(sandboxd)


@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs setpriv (util-linux)")
def test_read_only_dirs_are_removed_by_a_service_without_privileges(tmp_path: Path) -> None:
    """As under compose: root without CAP_DAC_OVERRIDE. Before: a dir the program made
    read-only could not be emptied, and each such run left its run dir (all it wrote) in
    /dev/shm."""
    server = start_sandboxd(
        env={"TOOLENV_SANDBOX_WORKDIR_ROOT": str(tmp_path)},
        wrap=["setpriv", "--bounding-set", "-all,+setfcap"],
    )
    try:
        programs = {
            "python": "import os\nos.mkdir('d'); open('d/x', 'w').write('x')\n"
            "os.chmod('d', 0o500); os.chmod('.', 0o500); print('done')",
            "bash": "mkdir -p e/f; echo x > e/f/y; chmod 000 e/f; chmod 500 e; echo done",
        }
        for language, code in programs.items():
            res = server.run_code(code=code, language=language)
            assert res["run_result"]["stdout"] == "done\n", res
        leftovers = [p for p in tmp_path.rglob("*") if p.name.startswith("run-")]
        assert leftovers == []
    finally:
        server.stop()


def test_no_network_dns_or_host_loopback(sandboxd: SandboxdServer) -> None:
    accepted: list[object] = []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        stop = threading.Event()

        def accept() -> None:
            while not stop.is_set():
                try:
                    accepted.append(listener.accept())
                except OSError:
                    pass

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        code = (
            "import socket\n"
            "try:\n"
            "    print('dns', socket.getaddrinfo('example.com', 80))\n"
            "except OSError as e:\n"
            "    print('dns failed', type(e).__name__)\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print('connect failed', type(e).__name__)\n"
        )
        res, _ = run(sandboxd, code, run_timeout=10)
        stop.set()
        t.join(2)
    out = res["run_result"]["stdout"]
    assert "dns failed" in out and "connect failed" in out, out
    assert not accepted
    check_still_clean(sandboxd)


def test_host_secrets_are_not_readable(sandboxd: SandboxdServer) -> None:
    code = (
        "import os\n"
        "for path in ['/etc/shadow', '/etc/passwd', '/proc/1/environ', '/root/.bashrc']:\n"
        "    try:\n"
        "        print(path, open(path, 'rb').read()[:200])\n"
        "    except OSError as e:\n"
        "        print(path, 'denied', type(e).__name__)\n"
        "print(sorted(os.environ.items()))\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit():\n"
        "        print(pid, open(f'/proc/{pid}/cmdline', 'rb').read())\n"
    )
    res, _ = run(sandboxd, code)
    out = res["run_result"]["stdout"] + res["run_result"]["stderr"]
    assert SECRET not in out
    assert "/etc/shadow denied" in out
    assert "TOOLENV" not in out  # nothing of the service's environment
    assert "sandboxd" not in out  # the service's command line is not visible either
    check_still_clean(sandboxd)


def test_writes_outside_the_workdir_do_not_reach_the_host(sandboxd: SandboxdServer) -> None:
    marker = f"toolenv-escape-{time.time_ns()}"
    code = (
        "import os\n"
        f"for d in ['/usr', '/etc', '/', '/tmp', '/dev', '/proc', '/sandbox/..', '/dev/shm']:\n"
        f"    p = os.path.join(d, '{marker}')\n"
        "    try:\n"
        "        open(p, 'w').write('x')\n"
        "        print('wrote', p)\n"
        "    except OSError as e:\n"
        "        print('denied', p, type(e).__name__)\n"
    )
    res, _ = run(sandboxd, code)
    assert "denied /usr/" in res["run_result"]["stdout"], res
    for d in ["/usr", "/etc", "/", "/tmp", "/dev", "/dev/shm", "/work"]:
        assert not (Path(d) / marker).exists(), d
    check_still_clean(sandboxd)


def test_daemon_does_not_outlive_its_run(sandboxd: SandboxdServer) -> None:
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(30)\n"
        "        open('/sandbox/daemon-was-here', 'w').write('x')\n"
        "    os._exit(0)\n"
        "print('parent done', flush=True)\n"
    )
    res, elapsed = run(sandboxd, code, run_timeout=10)
    assert res["status"] == "Success"
    assert elapsed < 5  # the run ends with its main program, not with the daemon
    check_still_clean(sandboxd)


def test_a_shell_or_compiled_programs_daemon_does_not_outlive_its_run(
    sandboxd: SandboxdServer,
) -> None:
    """Programs other than python run under bwrap's init, not as their namespace's init: the
    namespace still ends with the program, so a setsid daemon it started dies with it."""
    code = "(setsid sh -c 'sleep 30; echo x > /sandbox/daemon-was-here' &)\necho parent done\n"
    res, elapsed = run(sandboxd, code, language="bash", run_timeout=10)
    assert res["status"] == "Success", res
    assert res["run_result"]["stdout"] == "parent done\n"
    assert elapsed < 5  # the run ends with its main program, not with the daemon
    check_still_clean(sandboxd)


def test_killing_its_parent_harms_nothing(sandboxd: SandboxdServer) -> None:
    code = (
        "import os, signal\n"
        "for target in (os.getppid(), 1, -1):\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "    except OSError as e:\n"
        "        print('kill', target, type(e).__name__)\n"
        "if os.fork() == 0:\n"
        "    os.kill(os.getppid(), signal.SIGKILL)\n"
        "    os._exit(0)\n"
        "os.wait()\n"
        "print('done')\n"
    )
    res, _ = run(sandboxd, code, run_timeout=5)
    assert res["status"] in ("Success", "Failed")
    check_still_clean(sandboxd)
