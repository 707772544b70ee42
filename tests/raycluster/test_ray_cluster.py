"""toolenv on a real two-node Ray cluster (two network namespaces on this machine).

In file order: load spreads over sandbox replicas on both nodes; the gateway contract holds
through Ray (deadline kills the program, 429 + Retry-After, metrics, trace capture); the study's
cells as Ray tasks give the local report; a second application that fails to start is deleted
and the first one still serves; a second application whose gateway runs on the other node is
found ready there; a foreground start with the running application's name is refused; the
second node's raylet dies under load and every
call still gets a clean answer, the deployment recovers on the surviving node and nothing is
left behind; then, on the surviving node, autoscaling follows queued calls within its bounds
and back.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from ray_support import APP, BASE_CONFIG, URL, RayEnv, leftovers

pytestmark = [pytest.mark.slow, pytest.mark.bwrap, pytest.mark.timeout(600)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def statuses(results: list[dict]) -> dict[int, int]:
    out: dict[int, int] = {}
    for r in results:
        out[r["status"]] = out.get(r["status"], 0) + 1
    return out


def test_load_reaches_sandbox_replicas_on_both_nodes(ray_env: RayEnv) -> None:
    results = ray_env.load("--calls", "24", "--concurrency", "4", "--sleep-s", "0.05")
    assert statuses(results) == {200: 24}, results[:3]
    assert all(json.loads(r["body"])["status"] == "Success" for r in results)
    nodes = {r["node"].split("/")[0] for r in results}
    assert nodes == {ray_env.head_ip, ray_env.worker_ip}
    assert len({r["replica"] for r in results}) == 2
    # one request id per answer (the gateway's), with no second one added on the way
    assert all(len(r["request_ids"]) == 1 for r in results), results[0]["request_ids"]
    assert len({r["request_ids"][0] for r in results}) == 24


def sandbox_timeouts(ray_env: RayEnv) -> float:
    """The gateway's count of sandbox calls whose deadline ended them."""
    for line in ray_env.helper("get", f"{URL}/metrics")["text"].splitlines():
        if line.startswith("toolenv_gateway_calls_total{") and 'tool="sandbox"' in line:
            if 'outcome="timeout"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_deadline_is_forwarded_and_the_replica_kills_the_program(ray_env: RayEnv) -> None:
    marker = "987.25"  # a sleep nobody else runs: find it in the process table
    code = f"import os\nos.execv('/bin/sleep', ['sleep', '{marker}'])\n"
    before = sandbox_timeouts(ray_env)
    results = ray_env.load("--calls", "2", "--concurrency", "2", "--code", code,
                           "--deadline-ms", "1500")  # fmt: skip
    # Whichever answered, the gateway counts a timeout: the replica marks the answer the
    # deadline ended (X-Toolenv-Deadline-Expired), and that header crosses Ray.
    assert sandbox_timeouts(ray_env) - before == 2
    for r in results:
        # The gateway's 504, or the sandbox's own answer: it stopped the program at the deadline
        # it was forwarded (SandboxFusion semantics: Failed, TimeLimitExceeded).
        body = json.loads(r["body"])
        assert r["elapsed_s"] < 1.5 + 1.0, r
        if r["status"] == 504:
            assert body["tool"] == "sandbox"
        else:
            assert r["status"] == 200 and body["run_result"]["status"] == "TimeLimitExceeded", r
    time.sleep(1.0)
    running = subprocess.run(["pgrep", "-f", f"sleep {marker}"], capture_output=True, text=True)
    assert running.stdout.strip() == "", "the program outlived its deadline"


def test_bodies_and_replies_above_grpcs_default_message_size_pass(ray_env: RayEnv) -> None:
    """A 6 MB program that prints 6 MB is answered as the local gateway answers it: within the
    gateway's body bound and sandboxd's output bound, above gRPC's 4 MiB default."""
    code = "import sys\nsys.stdout.write('y' * 6_000_000)\n"
    results = ray_env.load("--calls", "1", "--concurrency", "1", "--code", code,
                           "--pad-bytes", "6000000", "--max-output-bytes", "8000000")  # fmt: skip
    assert statuses(results) == {200: 1}, results[0]["body"][:300]
    assert results[0]["body"].startswith('{"status":"Success"'), results[0]["body"][:300]
    assert results[0]["body_bytes"] > 6_000_000


def test_admission_answers_429_with_retry_after(ray_env: RayEnv) -> None:
    results = ray_env.load("--tool", "sandbox_tight", "--calls", "6", "--concurrency", "6",
                           "--sleep-s", "1")  # fmt: skip
    counts = statuses(results)
    assert counts.get(200, 0) >= 1 and counts.get(429, 0) >= 1, counts
    assert set(counts) <= {200, 429}
    assert all(r["retry_after"] for r in results if r["status"] == 429)


def test_metrics_and_trace_capture_through_ray(ray_env: RayEnv) -> None:
    results = ray_env.load("--tool", "search", "--calls", "4", "--trajectory", "traj-ray-1")
    assert statuses(results) == {200: 4}
    metrics = ray_env.helper("get", f"{URL}/metrics")["text"]
    assert 'tool="search"' in metrics and 'tool="sandbox"' in metrics
    end = time.monotonic() + 10
    while time.monotonic() < end:
        lines = ray_env.trace.read_text().splitlines() if ray_env.trace.exists() else []
        captured = [json.loads(x) for x in lines if "traj-ray-1" in x]
        if len(captured) == 4:
            break
        time.sleep(0.2)
    assert sorted(r["turn"] for r in captured) == [0, 1, 2, 3]
    assert all(r["tool_name"] == "search" and r["status"] == "success" for r in captured)


def test_study_on_ray_gives_the_local_report(ray_env: RayEnv, polytrace_dir: Path) -> None:
    args = [
        "rollout", "study", "--quick", "--batch", "32", "--steps", "1", "--json", "--no-plots",
        "--trace", str(polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"),
        "--reward-trace", str(polytrace_dir / "rllm_deepcoder" / "reward_timings_step_0.jsonl"),
    ]  # fmt: skip
    local = subprocess.run([sys.executable, "-m", "toolenv", *args, "--out", str(ray_env.workdir / "local")],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert local.returncode == 0, local.stderr[-2000:]
    on_ray = ray_env.run([sys.executable, "-m", "toolenv", *args, "--out", str(ray_env.workdir / "ray"),
                          "--ray", ray_env.cluster.address], timeout=300)  # fmt: skip
    assert on_ray.returncode == 0, on_ray.stderr[-2000:]

    def comparable(out: str) -> dict:
        study = json.loads(out)
        for cell in study["cells"]:
            cell.pop("wall_s")  # how long the cell took to compute: the one thing that differs
        return study

    here, there = comparable(local.stdout), comparable(on_ray.stdout)
    assert len(here["cells"]) == 35
    assert there == here


def test_a_failed_start_deletes_its_application_and_leaves_the_others(ray_env: RayEnv) -> None:
    """A second application whose sandbox replicas no node can take (a resource no node has):
    one line naming the deployment, exit 1 at `--ready-timeout`, and the application it deployed
    is gone (before: left deployed, its gateway and emulator replicas running, the sandbox one
    waiting for ever); the fixture's application still runs."""
    config = copy.deepcopy(BASE_CONFIG)
    config["ray"] |= {"app_name": "toolenv-unplaceable", "http_port": 8001}
    config["ray"]["sandbox"]["resources"] = {"no_such_node": 1}
    done = ray_env.serve_detached(config, "unplaceable", "--ready-timeout", "10")
    assert done.returncode == 1, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(said) == 1, done.stderr[-3000:]
    assert "not running after 10 s" in said[0] and "sandbox: " in said[0], said
    assert "deleted" in said[0], said
    assert "Traceback" not in done.stderr
    assert ray_env.applications() == {APP: "RUNNING"}
    results = ray_env.load("--calls", "4", "--concurrency", "2")
    assert statuses(results) == {200: 4}


def test_a_gateway_on_another_node_is_found_ready_where_it_runs(ray_env: RayEnv) -> None:
    """A second application whose gateway replica runs on the other node (pinned there here;
    Ray places a replica on any node with room, and a head with no CPUs takes none): the
    command that deploys it from the head exits 0 naming that node, and the gateway answers
    there. Before: it read `/readyz` on the head's own loopback, where nothing listens, until
    `--ready-timeout`, then deleted an application that served."""
    app = "toolenv-elsewhere"
    config = copy.deepcopy(BASE_CONFIG)
    config["ray"] |= {"app_name": app, "http_port": 8002}
    config["ray"]["gateway"]["resources"] = {"node_w1": 0.01}
    config["ray"]["sandbox"] |= {"num_cpus": 0, "min_replicas": 1, "max_replicas": 1}
    config["ray"]["emulators"] |= {"min_replicas": 1, "max_replicas": 1}
    try:
        done = ray_env.serve_detached(config, "elsewhere", "--ready-timeout", "30")
        said = " ".join(done.stderr.split())  # the console wraps its lines
        assert done.returncode == 0, said[-3000:]
        assert f"serving on Ray at http://127.0.0.1:8002 on node {ray_env.worker_ip}" in said
        got = ray_env.helper("get", "http://127.0.0.1:8002/readyz", node=1)
        assert got["status"] == 200, got
    finally:
        ray_env.helper("delete", ray_env.cluster.address, app)
    assert ray_env.applications() == {APP: "RUNNING"}


def test_a_foreground_start_refuses_an_application_that_already_runs(ray_env: RayEnv) -> None:
    """`toolenv serve --ray ADDRESS` in the foreground, with the name of an application that
    runs: one line, exit 1, and the application is left as it was. Before: it took the running
    application over (restarting its replicas), said it served, and deleted it at Ctrl-C from
    under the command or user that had deployed it."""
    argv = [sys.executable, "-m", "toolenv", "serve", "--ray", ray_env.cluster.address]
    done = ray_env.run([*argv, "-c", str(ray_env.workdir / "base.yaml")], timeout=90)
    said = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 1 and len(said) == 1, done.stderr[-3000:]
    assert f"application {APP!r} already runs on this cluster" in said[0], said
    assert ray_env.applications() == {APP: "RUNNING"}
    assert statuses(ray_env.load("--calls", "4", "--concurrency", "2")) == {200: 4}


def test_node_death_mid_load(ray_env: RayEnv) -> None:
    before = ray_env.wait_replicas("sandbox", 2, 60)  # the fixture's deployment
    assert before["sandbox"].get("RUNNING") == 2
    warm = ray_env.load("--calls", "8", "--concurrency", "4")
    assert {r["node"].split("/")[0] for r in warm} == {ray_env.head_ip, ray_env.worker_ip}
    # the second node's Ray workers, its replicas among them ("ray::ServeReplica:...", not the
    # node's agents): a worker exits when its raylet dies
    worker_pids = {
        p for p in ray_env.cluster.pids(1)
        if _cmdline(p).startswith(b"ray::") and b"Agent" not in _cmdline(p)
    }  # fmt: skip
    assert worker_pids, "no Ray worker process on the second node"
    deadline_ms = 5000
    common = ["--deadline-ms", str(deadline_ms), "--grace-s", "5", "--max-s", "30"]
    loads = [
        subprocess.Popen(
            ray_env.helper_argv(
                "load",
                URL,
                "--tool",
                tool,
                "--calls",
                "80",
                "--concurrency",
                "4",
                "--sleep-s",
                "0.2",
                *common,
            ),  # fmt: skip
            env=ray_env.cluster.env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        for tool in ("sandbox", "search")
    ]
    time.sleep(3)
    ray_env.cluster.kill_raylet(1)
    results = []
    for load in loads:
        out, _ = load.communicate(timeout=120)
        results += json.loads(out.strip().splitlines()[-1])

    summary = Counter((r["tool"], r["status"]) for r in results)
    print(f"node death: answers by (tool, status): {dict(summary)}")
    for r in results:
        assert r["status"] != 0, f"no answer: {r}"
        assert r["elapsed_s"] <= deadline_ms / 1000 + 1.0, f"answered after its deadline: {r}"
        if r["status"] != 200:
            # a clean failure that names the tool: broken mid-call (502), no replica (503), or
            # its deadline reached while Ray had not yet declared the node dead (504)
            assert r["status"] in (502, 503, 504), f"{summary}: {r}"
            assert json.loads(r["body"])["tool"] == r["tool"], r
    assert summary[("sandbox", 200)] >= 40, summary
    assert summary[("search", 200)] >= 72, summary  # idempotent: retried on another replica

    after = ray_env.wait_replicas("sandbox", 2, 90, alive_nodes=1)
    assert after["sandbox"].get("RUNNING") == 2, after
    assert after["_alive_nodes"] == [ray_env.head_ip]
    again = ray_env.load("--calls", "8", "--concurrency", "4")
    assert statuses(again) == {200: 8}
    assert {r["node"].split("/")[0] for r in again} == {ray_env.head_ip}

    # The dead node's replicas are gone (a worker exits when its raylet dies; its sandboxes die
    # with it); their run dirs
    # and cgroups go when the next replica starts on that host (checked in the next test).
    end = time.monotonic() + 20
    while (
        alive := [p for p in worker_pids if Path(f"/proc/{p}").exists()]
    ) and time.monotonic() < end:
        time.sleep(0.5)
    assert alive == [], alive
    ray_env.dead_node_pids |= worker_pids


def test_autoscaling_follows_queued_calls_within_bounds(ray_env: RayEnv) -> None:
    config = copy.deepcopy(BASE_CONFIG)
    config["ray"]["sandbox"] = {
        "num_cpus": 0.25, "max_ongoing_requests": 1, "min_replicas": 1, "max_replicas": 3,
        "target_ongoing_requests": 1, "upscale_delay_s": 0.5, "downscale_delay_s": 2,
    }  # fmt: skip
    ray_env.deploy(config, "autoscale")
    assert ray_env.wait_replicas("sandbox", 1, 60)["sandbox"].get("RUNNING") == 1
    load = subprocess.Popen(
        ray_env.helper_argv(
            "load",
            URL,
            "--calls",
            "40",
            "--concurrency",
            "8",
            "--sleep-s",
            "1",
            "--deadline-ms",
            "30000",
            "--max-s",
            "40",
        ),  # fmt: skip
        env=ray_env.cluster.env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    peak = 1
    while load.poll() is None:
        running = ray_env.replicas()["sandbox"].get("RUNNING", 0)
        peak = max(peak, running)
        assert running <= 3
    out, _ = load.communicate(timeout=60)
    results = json.loads(out.strip().splitlines()[-1])
    assert statuses(results) == {200: 40}
    assert peak > 1, "queued calls did not add a replica"
    after = ray_env.wait_replicas("sandbox", 1, 60)
    assert after["sandbox"].get("RUNNING") == 1, after
    # Replicas started since the node died reaped what its replicas left on this host.
    assert leftovers(ray_env.dead_node_pids) == []
