"""The hostile suite of the process backend, run through the compose stack's gateway.

The same test functions as tests/sandboxd/test_process_hostile.py; here `sandboxd` is the compose
sandbox service behind the published gateway port, and the leak probe looks inside its container
(processes, run dirs and cgroup tasks beyond the idle warm sandboxes).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from compose_support import Stack

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sandboxd"))
from test_process_hostile import (  # noqa: E402
    test_daemon_does_not_outlive_its_run,
    test_filling_the_disk_stops_at_the_limits,
    test_fork_bomb_is_bounded_and_reaped,
    test_host_secrets_are_not_readable,
    test_infinite_loop_is_killed_at_the_run_timeout,
    test_killing_its_parent_harms_nothing,
    test_memory_bomb_is_memory_limit_exceeded,
    test_no_network_dns_or_host_loopback,
    test_one_gigabyte_flood_is_cut_at_the_cap,
    test_sleep_ignoring_sigterm_is_killed_with_partial_output,
    test_writes_outside_the_workdir_do_not_reach_the_host,
)

__all__ = [
    "test_daemon_does_not_outlive_its_run",
    "test_filling_the_disk_stops_at_the_limits",
    "test_fork_bomb_is_bounded_and_reaped",
    "test_host_secrets_are_not_readable",
    "test_infinite_loop_is_killed_at_the_run_timeout",
    "test_killing_its_parent_harms_nothing",
    "test_memory_bomb_is_memory_limit_exceeded",
    "test_no_network_dns_or_host_loopback",
    "test_one_gigabyte_flood_is_cut_at_the_cap",
    "test_sleep_ignoring_sigterm_is_killed_with_partial_output",
    "test_writes_outside_the_workdir_do_not_reach_the_host",
    "test_a_run_filling_its_working_dir_leaves_room_for_the_others",
]


class _ServicePing:
    """GETs on the sandbox service itself (inside its container; it publishes no port)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack

    def get(self, path: str) -> httpx.Response:
        code = f"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8002{path}').read().decode())"
        return httpx.Response(200, content=self.stack.exec("sandbox", "python", "-c", code).strip())


class _ContainerProbe:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack

    def baseline(self) -> None:
        pass

    def assert_clean(self, timeout: float = 15) -> None:
        end = time.monotonic() + timeout
        while True:
            state = self.stack.sandbox_state()
            left = {k: state[k] for k in ("procs", "tasks", "dirs") if state[k]}
            if not left and state["running"] == 0 and state["draining"] == 0:
                return
            assert time.monotonic() < end, f"left behind in the sandbox container: {state}"
            time.sleep(0.2)


class ComposeSandbox:
    """What the hostile tests use of a sandboxd server, served by the compose stack."""

    def __init__(self, stack: Stack) -> None:
        self.client = _ServicePing(stack)
        self.probe = _ContainerProbe(stack)
        self.stack = stack

    def run_code(self, **body: object) -> dict:
        r = self.stack.client.post("/run_code", json=body)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def sandboxd(stack: Stack) -> ComposeSandbox:
    stack.wait_healthy("sandbox")
    server = ComposeSandbox(stack)
    server.probe.assert_clean()
    return server


# Writes 640 MB of files (32 MB each: under the 64 MB file-size limit), says so, then holds them.
FILLER = (
    "import time\n"
    "n = 0\n"
    "try:\n"
    "    for i in range(20):\n"
    "        with open(f'fill{i}', 'wb') as f:\n"
    "            for _ in range(32):\n"
    "                f.write(b'x' * (1 << 20)); n += 1\n"
    "except OSError as e:\n"
    "    print(e.strerror, flush=True)\n"
    "print('wrote', n, 'MB', flush=True)\n"
    "time.sleep(8)\n"
)


def test_a_run_filling_its_working_dir_leaves_room_for_the_others(
    sandboxd: ComposeSandbox,
) -> None:
    """A run's files are bounded by its own memory limit (tmpfs pages charged to its cgroup), not
    by a shared cap on the run dirs' tmpfs that one run could fill for every other run."""
    filled: list[dict] = []
    filler = threading.Thread(
        target=lambda: filled.append(
            sandboxd.run_code(code=FILLER, run_timeout=20, memory_limit_MB=1024)
        )
    )
    filler.start()
    try:
        time.sleep(3)  # the filler has written its files (well under a second) and holds them
        for language, code in (("python", "print(6 * 7)"), ("c", "int main(void) { return 0; }")):
            res = sandboxd.run_code(code=code, language=language)
            assert res["status"] == "Success", (language, res)
    finally:
        filler.join(30)
    assert filled and filled[0]["run_result"]["stdout"] == "wrote 640 MB\n", filled
    sandboxd.probe.assert_clean()
