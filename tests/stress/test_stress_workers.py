"""The load generator's worker processes and Ctrl-C, against a real loopback server."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from stress import (
    LoadSpec,
    LoadSpecError,
    run_load,
)
from stress.interrupt import forward_sigint, sigint_blocked_for_children
from stress.spec import Progress


def test_workers_split_and_merge(zero_server: str) -> None:
    result = run_load(LoadSpec(url=zero_server + "/x", rate=200, duration_s=1.0, workers=2))
    assert result.n == 200
    assert result.summary()["outcomes"]["ok"]["count"] == 200
    gaps = np.diff(result.scheduled)
    assert np.allclose(gaps, 1 / 200, atol=1e-6)  # interleaved into one evenly spaced stream


def test_workers_report_progress_as_one_run(zero_server: str) -> None:
    """The live display got no snapshot from worker processes (it read "starting ..." for the
    whole run); now each worker's snapshots reach `progress`, merged into one."""
    seen: list[Progress] = []
    spec = LoadSpec(url=zero_server + "/x", rate=200, duration_s=1.0, workers=2)
    spec.progress = seen.append
    result = run_load(spec)
    started = [p for p in seen if p.elapsed_s >= 0]
    assert len(started) >= 2
    assert seen[-1].completed == result.n == 200 and seen[-1].scheduled == 200
    assert all(a.completed <= b.completed for a, b in zip(started, started[1:], strict=False))


@pytest.mark.parametrize("arrival", ["constant", "closed"])
def test_ctrl_c_ends_the_run_with_what_it_measured(zero_server: str, arrival: str) -> None:
    """SIGINT during a run lost all of it (KeyboardInterrupt out of the loop). Now sending
    stops, the requests in flight finish, and the result holds every request sent before it."""
    pressed: list[Progress] = []

    def press_once(p: Progress) -> None:
        if p.completed and not pressed:
            pressed.append(p)
            signal.raise_signal(signal.SIGINT)

    spec = LoadSpec(
        url=zero_server + "/x", rate=200, duration_s=60, arrival=arrival, concurrency=2,
        progress=press_once, progress_interval_s=0.1, interruptible=True,
    )  # fmt: skip
    result = run_load(spec)
    assert pressed and result.interrupted
    assert result.summary()["stopped_by"] == "interrupted"
    assert 0 < result.n < 12_000 and result.n >= pressed[0].completed
    assert not np.isnan(result.done).any()  # each request sent got its end
    assert result.summary()["outcomes"]["ok"]["count"] == result.n


def _children(pid: int) -> set[int]:
    """The live child processes of `pid` (from /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == str(pid) and fields[0] != "Z":
            found.add(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_workers_end_with_the_process_that_started_them(zero_server: str, sig: int) -> None:
    """A `timeout`, a CI job's cancel or a kill ended the parent of a `--workers` run, and its
    workers went on sending for the rest of --duration (up to an hour), orphaned."""
    root = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "-m", "stress", "--url", zero_server + "/x", "--rate", "20",
            "--workers", "2", "--duration", "120s", "--quiet"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: set[int] = set()
    try:
        end = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < end and proc.poll() is None:
            workers = {
                p for p in _children(proc.pid)
                if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()
            }  # fmt: skip
            time.sleep(0.2)
        assert len(workers) == 2, "the two workers never started"
        time.sleep(2.0)  # past their common start: sending
        proc.send_signal(sig)
        proc.wait(timeout=30)
        end = time.monotonic() + 10
        while any(_alive(p) for p in workers) and time.monotonic() < end:
            time.sleep(0.1)
        assert not [p for p in workers if _alive(p)], "workers outlived their parent"
    finally:
        proc.kill()
        proc.wait()
        for p in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


def test_ctrl_c_while_workers_start_is_a_report_not_a_traceback(zero_server: str) -> None:
    """Ctrl-C (SIGINT to the terminal's process group) while the `--workers` were still
    importing was a KeyboardInterrupt traceback in each, a broken pipe in the parent, exit 1 and
    no report. Now each worker holds it for its run: nothing sent, exit 130, the report."""
    root = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "-m", "stress", "--url", zero_server + "/x", "--rate", "20",
            "--workers", "2", "--duration", "60s", "--quiet"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        end = time.monotonic() + 60
        while time.monotonic() < end and proc.poll() is None:
            spawned = [
                p for p in _children(proc.pid)
                if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()
            ]  # fmt: skip
            if len(spawned) == 2:
                break
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C does: the parent and its workers
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err and b"stopped by Ctrl-C: " in out


def test_workers_send_exactly_the_request_cap(zero_server: str) -> None:
    """Each worker took max_requests // workers (at least 1): a cap of 5 over 2 workers sent 4,
    and a cap of 3 over 4 workers sent 4, past the cap. The shares now add up to the cap, the
    first requests of the interleaved schedule, and a cap below the workers is refused."""
    spec = dict(url=zero_server + "/x", rate=100, duration_s=5.0, max_requests=5, workers=2)
    result = run_load(LoadSpec(**spec))
    assert result.n == 5 and result.summary()["stopped_by"] == "max_requests"
    assert np.allclose(result.scheduled, np.arange(5) / 100, atol=1e-6)
    with pytest.raises(LoadSpecError, match="more than max_requests"):
        run_load(LoadSpec(**{**spec, "max_requests": 3, "workers": 4}))


def test_workers_at_a_constant_rate_send_the_schedule_of_one_process(zero_server: str) -> None:
    """Each worker planned its own ceil(rate / k x duration): 3 requests due in 10 ms at 300 rps
    were 4 on 2 workers, the last one due at 10 ms, after the duration (10,002 requests at
    1,000 rps for 10 s on 3 workers). A schedule of fewer requests than workers is refused."""
    spec = dict(url=zero_server + "/x", rate=300, duration_s=0.01, workers=2)
    result = run_load(LoadSpec(**spec))
    assert result.n == 3 and np.allclose(result.scheduled, np.arange(3) / 300, atol=1e-6)
    with pytest.raises(LoadSpecError, match="more than the requests scheduled at rate"):
        run_load(LoadSpec(**{**spec, "workers": 4}))


def test_a_ctrl_c_while_workers_are_spawned_is_not_lost_to_another_thread() -> None:
    """Ctrl-C while the workers were being spawned was lost to everyone about one time in eight,
    and the run went on to its end: the parent ignored SIGINT then (for its children to inherit),
    blocked in its main thread only, and another thread (numpy's, or any) took it and dropped it.
    Now the parent keeps its handler and the press is counted (its workers hold theirs)."""
    idle = threading.Event()
    other = threading.Thread(target=idle.wait, daemon=True)  # SIGINT not blocked, as numpy's
    other.start()
    try:
        with forward_sigint([]) as presses:
            with sigint_blocked_for_children():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)
            time.sleep(0.05)
        assert presses == [signal.SIGINT]
    finally:
        idle.set()
        other.join()
