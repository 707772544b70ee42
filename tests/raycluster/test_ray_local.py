"""`toolenv serve --ray local`: it starts a local cluster (`ray.init()`), serves, and
Ctrl-C deletes the application and stops that cluster. Run in a network namespace of its own
(its own loopback and ports), so it meets no other Ray on the machine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from ray_support import leftovers, sandbox_replica_pids

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


def _serve_command(ns: NetnsCluster, tmp_path: Path, config: dict) -> tuple[list[str], dict]:
    """`toolenv serve --ray local` in the head's namespace, and its environment: Ray's defaults
    for a local cluster (token auth on), with the token it writes in a home of this test's own
    rather than in ~/.ray, where every later `ray start` would see it."""
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = [sys.executable, "-m", "toolenv", "serve", "--ray", "local", "-c", str(path)]
    env = {k: v for k, v in ns.env().items() if k != "RAY_AUTH_MODE"} | {"HOME": str(tmp_path)}
    return ns.exec_argv(argv), env


def _start_serve(
    ns: NetnsCluster,
    tmp_path: Path,
    until: str,
    config: dict = CONFIG,
    sigint_ignored: bool = False,
) -> tuple[subprocess.Popen[str], str]:
    """The command started, and what it said on stderr up to the line holding `until`."""
    argv, env = _serve_command(ns, tmp_path, config)
    server = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True,
                              preexec_fn=_ignore_sigint if sigint_ignored else None)  # fmt: skip
    assert server.stderr is not None
    end, said = time.monotonic() + 200, ""
    while until not in said and server.poll() is None and time.monotonic() < end:
        said += server.stderr.readline()
    assert until in said, said[-3000:]
    return server, said


def _assert_no_process_left(ns: NetnsCluster) -> None:
    end = time.monotonic() + 30
    while ns.pids(0) and time.monotonic() < end:
        time.sleep(0.5)
    assert ns.pids(0) == []


# Ctrl-C from a job started in the background (SIGINT ignored from birth, as a shell does), and
# `kill`: the two ways a user stops the command.
EACH_WAY_TO_STOP = pytest.mark.parametrize(
    ("stop_signal", "started_with_sigint_ignored"),
    [(signal.SIGINT, True), (signal.SIGTERM, False)],
    ids=["ctrl-c-from-a-background-job", "sigterm"],
)


@EACH_WAY_TO_STOP
def test_serve_ray_local_starts_and_stops_a_local_cluster(
    tmp_path: Path, stop_signal: signal.Signals, started_with_sigint_ignored: bool
) -> None:
    ns = NetnsCluster(workers=0).start(ray=False)
    try:
        # ready once `--ray` prints that it serves (it waits for /readyz itself)
        server, _ = _start_serve(
            ns, tmp_path, "serving on Ray", sigint_ignored=started_with_sigint_ignored
        )
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
        # a control read is one replica's answer (its pool, its profile): it says which
        for path, deployment in (("/v1/sandbox/status", "sandbox"), ("/v1/ping", "sandbox"),
                                 ("/v1/emulators/search/profile", "emulators")):  # fmt: skip
            got = helper("get", URL + path)
            assert got["status"] == 200, got
            assert (got["replica"] or "").startswith(f"{deployment}#"), (path, got)
            assert got["node"], (path, got)

        server.send_signal(stop_signal)  # the foreground command: Ctrl-C, or `kill`
        assert server.wait(120) == 0
        _assert_no_process_left(ns)  # the application and the cluster it started are gone
    finally:
        ns.stop()


@EACH_WAY_TO_STOP
def test_a_stop_signal_while_starting_stops_what_started(
    tmp_path: Path, stop_signal: signal.Signals, started_with_sigint_ignored: bool
) -> None:
    """Ctrl-C or `kill` once the cluster is up and the application is being deployed: one line,
    exit 128 + the signal, no cluster left. (Before: SIGINT from a background job was ignored
    and the command went on to serve; SIGTERM hit `ray.init`'s native handler, which crashed
    the driver with a segmentation fault.)"""
    ns = NetnsCluster(workers=0).start(ray=False)
    try:
        # connected; the deployments are starting
        server, said = _start_serve(
            ns, tmp_path, "Started Serve", sigint_ignored=started_with_sigint_ignored
        )
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
        _assert_no_process_left(ns)
    finally:
        ns.stop()


def test_a_deployment_that_cannot_start_says_why_and_stops_the_cluster(tmp_path: Path) -> None:
    """The gateway's port is taken: one line naming the deployment and the error its replicas
    raised (Serve's own says only "Failed to update the deployments"), exit 1, no cluster left."""
    ns = NetnsCluster(workers=0).start(ray=False)
    holder = None
    try:
        hold = "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 8000)); s.listen()\n"
        holder = subprocess.Popen(ns.exec_argv([sys.executable, "-c", hold + "time.sleep(300)"]))
        argv, env = _serve_command(ns, tmp_path, CONFIG)
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=200)
        assert done.returncode == 1, done.stderr[-3000:]
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        said = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(said) == 1 and "gateway: " in said[0] and "Address already in use" in said[0]
        holder.kill()
        holder.wait()
        _assert_no_process_left(ns)
    finally:
        if holder is not None:
            holder.kill()
        ns.stop()


def test_replicas_no_node_can_take_are_an_error_before_anything_is_deployed(
    tmp_path: Path,
) -> None:
    """A sandbox replica of more CPUs than the local cluster has: one line naming the deployment,
    the CPUs it asks for and those the node has, exit 1 at once, no cluster left. No node ever
    joins the command's own cluster: it waited out `--ready-timeout` (300 s by default; before
    that, "deploying" for ever, as `serve.run` waits without end)."""
    ns = NetnsCluster(workers=0).start(ray=False)
    try:
        config = {**CONFIG, "ray": {**CONFIG["ray"], "sandbox": {"num_cpus": 64}}}
        argv, env = _serve_command(ns, tmp_path, config)
        started = time.monotonic()
        done = subprocess.run([*argv, "--ready-timeout", "200"], env=env, capture_output=True,
                              text=True, timeout=250)  # fmt: skip
        assert done.returncode == 1, done.stderr[-3000:]
        assert time.monotonic() - started < 100
        said = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(said) == 1, done.stderr[-3000:]
        assert "no node of the local cluster can take sandbox" in said[0], said
        assert "{'CPU': 64.0}" in said[0], said  # the CPUs each replica asks for
        assert "Traceback" not in done.stderr
        _assert_no_process_left(ns)
    finally:
        ns.stop()


def test_stopping_with_a_call_in_flight_releases_the_sandbox_pool(tmp_path: Path) -> None:
    """SIGTERM while a program runs: the gateway's shutdown grace (here 22 s, above Serve's 20 s
    default for a replica's shutdown) runs out, its call is cancelled, and the sandbox replica
    releases its pool (run dir, cgroups) instead of being killed by Serve with them in place."""
    ns = NetnsCluster(workers=0).start(ray=False)
    try:
        config = {**CONFIG, "gateway": {"shutdown_grace_s": 22}}
        server, _ = _start_serve(ns, tmp_path, "serving on Ray", config)
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
        replicas = sandbox_replica_pids(ns.pids(0))
        assert replicas
        server.send_signal(signal.SIGTERM)
        assert server.wait(120) == 0
        call.wait(60)
        assert not _running(marker)
        # this cluster's replicas only: a sandboxd of another user of the machine is not ours
        assert leftovers(replicas) == []
    finally:
        ns.stop()


def _running(marker: str) -> bool:
    found = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True)
    return bool(found.stdout.strip())


def test_a_profile_change_that_would_reach_one_replica_of_two_is_refused(tmp_path: Path) -> None:
    """Two emulator replicas: a profile PUT through the gateway reaches the one Ray's router
    picks. It answered 200 and only that replica took it (calls drew from two profiles); it is
    a 409 saying why and what to do, and reads still answer."""
    ns = NetnsCluster(workers=0).start(ray=False)
    try:
        two = {"num_cpus": 0, "min_replicas": 2, "max_replicas": 2}
        config = {**CONFIG, "ray": {**CONFIG["ray"], "emulators": two}}
        server, _ = _start_serve(ns, tmp_path, "serving on Ray", config=config)
        threading.Thread(target=server.stderr.read, daemon=True).start()  # keep the pipe drained

        def helper(*args: str) -> dict:
            done = subprocess.run(ns.exec_argv([sys.executable, str(HELPER), *args]),
                                  env=ns.env(), capture_output=True, text=True, timeout=120)  # fmt: skip
            assert done.returncode == 0, done.stderr[-2000:]
            return json.loads(done.stdout.strip().splitlines()[-1])

        profile = '{"model": {"kind": "lognormal", "median_s": 0.01, "sigma": 0.1}}'
        put = helper("put", URL + "/v1/emulators/search/profile", profile)
        assert put["status"] == 409, put
        detail = json.loads(put["text"])["detail"]
        assert "up to 2 replicas" in detail and "emulators.search_profile" in detail, detail
        assert helper("get", URL + "/v1/emulators/search/profile")["status"] == 200

        server.send_signal(signal.SIGTERM)
        assert server.wait(120) == 0
        _assert_no_process_left(ns)
    finally:
        ns.stop()


# An HTTP server on 127.0.0.1:8000 whose socket has SO_REUSEPORT, as a gateway replica's has
REUSEPORT_SERVER = """
import http.server, socket
class Reuse(http.server.HTTPServer):
    def server_bind(self):
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        super().server_bind()
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")
Reuse(("127.0.0.1", 8000), Ok).serve_forever()
"""


def test_a_new_application_on_a_port_something_answers_at_is_refused(tmp_path: Path) -> None:
    """Another application's gateway (or a second local cluster's) already on the port: one
    line saying so, exit 1, no cluster left. Before, the new gateway replicas bound beside it
    (SO_REUSEPORT) and the command said it served, while the kernel split the calls between
    the two."""
    ns = NetnsCluster(workers=0).start(ray=False)
    holder = None
    try:
        holder = subprocess.Popen(ns.exec_argv([sys.executable, "-c", REUSEPORT_SERVER]))
        end = time.monotonic() + 20
        while "ok" not in subprocess.run(ns.exec_argv([sys.executable, str(HELPER), "get", URL]),
                                         capture_output=True, text=True).stdout:  # fmt: skip
            assert time.monotonic() < end and holder.poll() is None
            time.sleep(0.3)
        argv, env = _serve_command(ns, tmp_path, CONFIG)
        server = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
        assert server.stderr is not None
        out = ""
        while not ("error:" in out or "serving on Ray" in out) and server.poll() is None:
            out += server.stderr.readline()
        if "serving on Ray" in out:
            server.send_signal(signal.SIGTERM)
        out += server.communicate(timeout=120)[1]
        said = [line for line in out.splitlines() if line.startswith("error:")]
        assert server.returncode == 1, out[-3000:]
        assert len(said) == 1 and "http://127.0.0.1:8000 already answers" in said[0], said
        assert "Traceback" not in out
        holder.kill()
        holder.wait()
        _assert_no_process_left(ns)
    finally:
        if holder is not None:
            holder.kill()
        ns.stop()


def test_ctrl_c_after_the_cluster_died_says_so_at_once(tmp_path: Path) -> None:
    """The cluster's GCS killed while the command serves, then Ctrl-C: one line saying the
    cluster stopped answering and the application could not be deleted, exit 1 within seconds
    (before: "deleting the application", then about 50 s deaf to Ctrl-C while `serve.delete`
    waited on the dead GCS, and Ray's driver exiting 1 in a flood of native log lines)."""
    ns = NetnsCluster(workers=0).start(ray=False)
    try:
        server, _ = _start_serve(ns, tmp_path, "serving on Ray")
        out: list[str] = []
        drain = threading.Thread(target=lambda: out.append(server.stderr.read()), daemon=True)
        drain.start()
        gcs = [p for p in ns.pids(0) if Path(f"/proc/{p}/comm").read_text().strip() == "gcs_server"]
        assert len(gcs) == 1, gcs
        os.kill(gcs[0], signal.SIGKILL)
        time.sleep(1)
        server.send_signal(signal.SIGINT)
        started = time.monotonic()
        code = server.wait(120)
        waited = time.monotonic() - started
        drain.join(30)
        rest = "".join(out)
        assert code == 1, rest[-3000:]
        assert waited < 20, (waited, rest[-3000:])
        said = [line for line in rest.splitlines() if line.startswith("error:")]
        assert len(said) == 1 and "the Ray cluster stopped answering" in said[0], rest[-3000:]
        assert "could not be deleted" in said[0], said
        assert "Traceback" not in rest and "Failed to connect to GCS" not in rest, rest[-3000:]
    finally:
        ns.stop()


def test_an_address_where_something_else_answers_is_a_one_line_error_at_once(
    tmp_path: Path, polytrace_dir: Path
) -> None:
    """The dashboard's port (8265, the address `ray job submit` takes) given for the cluster's:
    the TCP check passed, and `ray.init` then retried for minutes, a log line every 5 s (the
    study still at 0 cells after 120 s). One line within seconds, as for a closed port."""
    ns = NetnsCluster(workers=0).start(ray=False)
    server = None
    try:
        address = f"{ns.head.ip}:8265"
        server = subprocess.Popen(
            ns.exec_argv([sys.executable, "-m", "http.server", "--bind", ns.head.ip, "8265"]),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(2)  # listening (it is in the namespace: not reachable from here to check)
        trace = str(polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl")
        for args in (["rollout", "study", "--quick", "--trace", trace, "--out", str(tmp_path / "out"),
                      "--ray", address], ["serve", "--ray", address, "--detach"]):  # fmt: skip
            started = time.monotonic()
            done = subprocess.run(ns.exec_argv([sys.executable, "-m", "toolenv", *args]),
                                  env=ns.env(), capture_output=True, text=True, timeout=60)  # fmt: skip
            assert done.returncode == 1, done.stderr[-3000:]
            assert time.monotonic() - started < 20
            assert done.stderr.strip().splitlines() == [
                f"error: no Ray cluster answers at {address}: something answers there, but not "
                "a Ray cluster's GCS (UNAVAILABLE) (--ray)"
            ], done.stderr[-3000:]
        assert not (tmp_path / "out").exists()
    finally:
        if server is not None:
            server.kill()
            server.wait()
        ns.stop()
