"""`toolenv serve --ray local`: it starts a local cluster (`ray.init()`), serves, and
Ctrl-C deletes the application and stops that cluster. Run in a network namespace of its own
(its own loopback and ports), so it meets no other Ray on the machine."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from toolenv.ray.netns import NetnsCluster

pytestmark = [pytest.mark.slow, pytest.mark.bwrap, pytest.mark.timeout(300)]

HELPER = Path(__file__).with_name("in_cluster.py")
URL = "http://127.0.0.1:8000"
CONFIG = {
    "ray": {
        "gateway": {"num_cpus": 0},
        "sandbox": {"num_cpus": 0.5, "max_ongoing_requests": 2},
        "emulators": {"num_cpus": 0},
    },
    "sandbox": {"warm_sandboxes": 1},
}


def _ignore_sigint() -> None:
    """What a background job of a non-interactive shell inherits: SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    ("stop_signal", "started_with_sigint_ignored"),
    [(signal.SIGINT, True), (signal.SIGTERM, False)],
    ids=["ctrl-c-from-a-background-job", "sigterm"],
)
def test_serve_ray_local_starts_and_stops_a_local_cluster(
    tmp_path: Path, stop_signal: signal.Signals, started_with_sigint_ignored: bool
) -> None:
    ns = NetnsCluster(workers=0).start(ray=False)
    try:
        config = tmp_path / "local.yaml"
        config.write_text(yaml.safe_dump(CONFIG))
        argv = [sys.executable, "-m", "toolenv", "serve", "--ray", "local", "-c", str(config)]
        # Ray's defaults for a local cluster (token auth on), with the token it writes in a home
        # of this test's own rather than in ~/.ray, where every later `ray start` would see it.
        env = {k: v for k, v in ns.env().items() if k != "RAY_AUTH_MODE"} | {"HOME": str(tmp_path)}
        server = subprocess.Popen(ns.exec_argv(argv), env=env, stderr=subprocess.PIPE, text=True,
                                  preexec_fn=_ignore_sigint if started_with_sigint_ignored else None)  # fmt: skip
        # ready once `--ray` prints that it serves (it waits for /readyz itself)
        assert server.stderr is not None
        end, said = time.monotonic() + 200, ""
        while "serving on Ray" not in said and server.poll() is None and time.monotonic() < end:
            said += server.stderr.readline()
        assert "serving on Ray" in said, said[-3000:]
        threading.Thread(target=server.stderr.read, daemon=True).start()  # keep the pipe drained

        def helper(*args: str) -> list[dict]:
            done = subprocess.run(ns.exec_argv([sys.executable, str(HELPER), *args]),
                                  env=ns.env(), capture_output=True, text=True, timeout=120)  # fmt: skip
            assert done.returncode == 0, done.stderr[-2000:]
            return json.loads(done.stdout.strip().splitlines()[-1])

        results = helper("load", URL, "--calls", "4", "--concurrency", "2")
        assert [r["status"] for r in results] == [200] * 4, results[0]
        assert all(r["replica"].startswith("sandbox#") for r in results)
        assert all(len(r["request_ids"]) == 1 for r in results)

        server.send_signal(stop_signal)  # the foreground command: Ctrl-C, or `kill`
        assert server.wait(120) == 0
        # the application and the cluster the command started are gone with it
        end = time.monotonic() + 30
        while ns.pids(0) and time.monotonic() < end:
            time.sleep(0.5)
        assert ns.pids(0) == []
    finally:
        ns.stop()


@pytest.mark.parametrize(
    ("stop_signal", "started_with_sigint_ignored"),
    [(signal.SIGINT, True), (signal.SIGTERM, False)],
    ids=["ctrl-c-from-a-background-job", "sigterm"],
)
def test_a_stop_signal_while_starting_stops_what_started(
    tmp_path: Path, stop_signal: signal.Signals, started_with_sigint_ignored: bool
) -> None:
    """Ctrl-C or `kill` once the cluster is up and the application is being deployed: one line,
    exit 128 + the signal, no cluster left. (Before: SIGINT from a background job was ignored
    and the command went on to serve; SIGTERM hit `ray.init`'s native handler, which crashed
    the driver with a segmentation fault.)"""
    ns = NetnsCluster(workers=0).start(ray=False)
    try:
        config = tmp_path / "local.yaml"
        config.write_text(yaml.safe_dump(CONFIG))
        argv = [sys.executable, "-m", "toolenv", "serve", "--ray", "local", "-c", str(config)]
        env = {k: v for k, v in ns.env().items() if k != "RAY_AUTH_MODE"} | {"HOME": str(tmp_path)}
        server = subprocess.Popen(ns.exec_argv(argv), env=env, stderr=subprocess.PIPE, text=True,
                                  preexec_fn=_ignore_sigint if started_with_sigint_ignored else None)  # fmt: skip
        assert server.stderr is not None
        end, said = time.monotonic() + 200, ""
        while "Started Serve" not in said and server.poll() is None and time.monotonic() < end:
            said += server.stderr.readline()
        assert "Started Serve" in said, said[-3000:]  # connected; the deployments are starting
        server.send_signal(stop_signal)
        out: list[str] = []
        drain = threading.Thread(target=lambda: out.append(server.stderr.read()), daemon=True)
        drain.start()  # Ray's processes hold the pipe too: read it aside, up to their end
        code = server.wait(120)
        drain.join(30)
        rest = "".join(out)
        assert code == 128 + stop_signal, (said + rest)[-3000:]
        assert f"interrupted ({stop_signal.name}) while starting" in rest, rest[-3000:]
        assert "serving on Ray" not in rest
        assert "Traceback" not in rest and "received at time" not in rest, rest[-3000:]
        end = time.monotonic() + 30
        while ns.pids(0) and time.monotonic() < end:
            time.sleep(0.5)
        assert ns.pids(0) == []
    finally:
        ns.stop()


def test_a_deployment_that_cannot_start_says_why_and_stops_the_cluster(tmp_path: Path) -> None:
    """The gateway's port is taken: one line naming the deployment and the error its replicas
    raised (Serve's own says only "Failed to update the deployments"), exit 1, no cluster left."""
    ns = NetnsCluster(workers=0).start(ray=False)
    holder = None
    try:
        config = tmp_path / "local.yaml"
        config.write_text(yaml.safe_dump(CONFIG))
        hold = "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 8000)); s.listen()\n"
        holder = subprocess.Popen(ns.exec_argv([sys.executable, "-c", hold + "time.sleep(300)"]))
        argv = [sys.executable, "-m", "toolenv", "serve", "--ray", "local", "-c", str(config)]
        env = {k: v for k, v in ns.env().items() if k != "RAY_AUTH_MODE"} | {"HOME": str(tmp_path)}
        done = subprocess.run(ns.exec_argv(argv), env=env, capture_output=True, text=True,
                              timeout=200)  # fmt: skip
        assert done.returncode == 1, done.stderr[-3000:]
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        said = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(said) == 1 and "gateway: " in said[0] and "Address already in use" in said[0]
        holder.kill()
        holder.wait()
        end = time.monotonic() + 30
        while ns.pids(0) and time.monotonic() < end:
            time.sleep(0.5)
        assert ns.pids(0) == []
    finally:
        if holder is not None:
            holder.kill()
        ns.stop()


def test_stopping_with_a_call_in_flight_releases_the_sandbox_pool(tmp_path: Path) -> None:
    """SIGTERM while a program runs: the gateway's shutdown grace (here 22 s, above Serve's 20 s
    default for a replica's shutdown) runs out, its call is cancelled, and the sandbox replica
    releases its pool (run dir, cgroups) instead of being killed by Serve with them in place."""
    ns = NetnsCluster(workers=0).start(ray=False)
    before = {d.name for d in Path("/dev/shm").glob("toolenv-sandboxd-*")}
    try:
        config = tmp_path / "local.yaml"
        config.write_text(yaml.safe_dump({**CONFIG, "gateway": {"shutdown_grace_s": 22}}))
        argv = [sys.executable, "-m", "toolenv", "serve", "--ray", "local", "-c", str(config)]
        env = {k: v for k, v in ns.env().items() if k != "RAY_AUTH_MODE"} | {"HOME": str(tmp_path)}
        server = subprocess.Popen(ns.exec_argv(argv), env=env, stderr=subprocess.PIPE, text=True)
        assert server.stderr is not None
        end, said = time.monotonic() + 200, ""
        while "serving on Ray" not in said and server.poll() is None and time.monotonic() < end:
            said += server.stderr.readline()
        assert "serving on Ray" in said, said[-3000:]
        threading.Thread(target=server.stderr.read, daemon=True).start()
        marker = "987.41"  # a sleep nobody else runs
        code = f"import os\nos.execv('/bin/sleep', ['sleep', '{marker}'])\n"
        call = subprocess.Popen(ns.exec_argv([sys.executable, str(HELPER), "load", URL, "--calls",
                                              "1", "--code", code, "--run-timeout", "50",
                                              "--deadline-ms", "55000"]),
                                env=ns.env(), stdout=subprocess.PIPE)  # fmt: skip
        end = time.monotonic() + 30
        while not _running(marker) and time.monotonic() < end:
            time.sleep(0.2)
        assert _running(marker)
        server.send_signal(signal.SIGTERM)
        assert server.wait(120) == 0
        call.wait(60)
        assert not _running(marker)
        left = {d.name for d in Path("/dev/shm").glob("toolenv-sandboxd-*")} - before
        cgroups = [p for n in left for p in Path("/sys/fs/cgroup").glob(f"*/{n}")]
        assert not left and not cgroups, (left, cgroups)
    finally:
        ns.stop()


def _running(marker: str) -> bool:
    found = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True)
    return bool(found.stdout.strip())
