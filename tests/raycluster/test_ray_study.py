"""`toolenv rollout study --ray ADDRESS` in network namespaces of its own: on a cluster where no
node has a CPU for a cell (a head started with `--num-cpus 0`, as clusters often run their head),
on two nodes (a calibrated cost profile, SIGTERM, a node dying mid-study), and on a local one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_client.engines import BUILTIN_PROFILES
from toolenv.ray.netns import NetnsCluster
from toolenv_core.ray_lean import CLUSTER_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_study_on_a_cluster_without_a_cpu_for_a_cell_says_why_it_waits(
    tmp_path: Path, polytrace_dir: Path
) -> None:
    """Ray holds tasks that no node can take until one joins: the study sat at 0 cells with
    no word. It says why, at once, and still waits (an autoscaler may add a node)."""
    ns = NetnsCluster(workers=0, num_cpus=0).start()
    try:
        argv = [sys.executable, "-m", "toolenv", "rollout", "study", "--quick", "--no-plots",
                "--trace", str(polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"),
                "--out", str(tmp_path / "out"), "--ray", ns.address]  # fmt: skip
        study = subprocess.Popen(ns.exec_argv(argv), env=ns.env(), stderr=subprocess.PIPE,
                                 stdout=subprocess.DEVNULL, text=True)  # fmt: skip
        lines: list[str] = []
        threading.Thread(target=lambda: lines.extend(study.stderr or ()), daemon=True).start()
        end = time.monotonic() + 90
        while not any("warning:" in x for x in lines) and time.monotonic() < end:
            time.sleep(0.5)
        study.send_signal(signal.SIGINT)
        study.wait(60)
        said = "".join(lines)
        assert "warning: no node of the cluster has the CPU a cell needs" in said, said[-2000:]
    finally:
        ns.stop()


# ---------------------------------------------------- a study on a two-node cluster (1 CPU each)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[NetnsCluster]:
    ns = NetnsCluster(workers=1, num_cpus=1).start()
    try:
        yield ns
    finally:
        ns.stop()


def _study_argv(polytrace_dir: Path, *args: str) -> list[str]:
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    return [sys.executable, "-m", "toolenv", "rollout", "study", "--trace", str(trace),
            "--no-plots", "--json", *args]  # fmt: skip


def _comparable(out: str) -> dict:
    study = json.loads(out)
    for cell in study["cells"]:
        cell.pop("wall_s")  # how long the cell took to compute: the one thing that differs
    return study


def test_a_cost_profile_file_reaches_every_cell_on_ray(
    two_nodes: NetnsCluster, tmp_path: Path, polytrace_dir: Path
) -> None:
    """`--cost-profile FILE` (what `toolenv rollout calibrate --out` writes): each cell's Ray
    worker read the path again, relative to its own directory and on its own node, and the
    study ended at once, exit 2, `error: ray::_cell() (pid=..., ip=...)`. The driver's copy
    reaches the cells: the local run's report."""
    (tmp_path / "calib.json").write_text(BUILTIN_PROFILES["searchr1-qwen7b"].model_dump_json())
    argv = _study_argv(polytrace_dir, "--quick", "--batch", "32", "--steps", "1",
                       "--cost-profile", "calib.json")  # fmt: skip
    local = subprocess.run([*argv, "--out", "local"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    assert local.returncode == 0, local.stderr[-2000:]
    on_ray = subprocess.run(two_nodes.exec_argv([*argv, "--out", "ray", "--ray", two_nodes.address]),
                            cwd=tmp_path, env=two_nodes.env(), capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert on_ray.returncode == 0, on_ray.stderr[-2000:]
    assert _comparable(on_ray.stdout) == _comparable(local.stdout)


def _ray_workers(ns: NetnsCluster, nodes: tuple[int, ...] = (0, 1)) -> list[str]:
    """The processes running a cell on these nodes."""
    found = []
    for node in nodes:
        for pid in ns.pids(node):
            with contextlib.suppress(OSError):
                if (name := Path(f"/proc/{pid}/comm").read_text().strip()) == "ray::_cell":
                    found.append(f"{pid} {name}")
    return found


def test_sigterm_ends_a_study_on_ray_as_it_ends_a_local_one(
    two_nodes: NetnsCluster, tmp_path: Path, polytrace_dir: Path
) -> None:
    """SIGTERM mid-study: the study unwinds (no report, no fresh --out) and ends by SIGTERM,
    as a local study does. Ray's driver put its own handlers in: exit 1 (with `local`, 134:
    aborted) and six lines of native stack dump; the cells stop with it."""
    argv = _study_argv(polytrace_dir, "--batch", "256", "--out", str(tmp_path / "out"),
                       "--ray", two_nodes.address)  # fmt: skip
    study = subprocess.Popen(two_nodes.exec_argv(argv), env=two_nodes.env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    end = time.monotonic() + 60
    while not _ray_workers(two_nodes) and study.poll() is None and time.monotonic() < end:
        time.sleep(0.2)
    assert _ray_workers(two_nodes), "no cell started"
    study.send_signal(signal.SIGTERM)
    _, said = study.communicate(timeout=30)
    assert study.returncode == -signal.SIGTERM, said[-2000:]
    assert "SIGTERM received" not in said and "Traceback" not in said, said[-2000:]
    assert not (tmp_path / "out").exists()
    end = time.monotonic() + 20
    while _ray_workers(two_nodes) and time.monotonic() < end:
        time.sleep(0.5)
    assert _ray_workers(two_nodes) == []


def test_a_node_dying_mid_study_leaves_stdout_the_report_alone(
    two_nodes: NetnsCluster, tmp_path: Path, polytrace_dir: Path
) -> None:
    """The second node dies mid-study (last here: the cluster keeps one node). Ray retries its
    cells on the head, and the report is the local one; what Ray's driver says of the death
    (the raylet's last log lines, the retries: about 50 lines) went to stdout, before the
    report, and `--json` was no JSON. It goes to stderr."""
    argv = _study_argv(polytrace_dir, "--batch", "256")
    study = subprocess.Popen(two_nodes.exec_argv([*argv, "--out", str(tmp_path / "ray"),
                                                  "--ray", two_nodes.address]),
                             env=two_nodes.env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    end = time.monotonic() + 60
    while not _ray_workers(two_nodes, (1,)) and study.poll() is None and time.monotonic() < end:
        time.sleep(0.2)
    assert _ray_workers(two_nodes, (1,)), "no cell started on the second node"
    two_nodes.kill_raylet(1)
    out, said = study.communicate(timeout=240)
    assert study.returncode == 0, said[-2000:]
    local = subprocess.run([*argv, "--out", str(tmp_path / "local")], capture_output=True,
                           text=True, timeout=240)  # fmt: skip
    assert local.returncode == 0, local.stderr[-2000:]
    assert _comparable(out) == _comparable(local.stdout)
    assert "(raylet)" in said, said[-2000:]  # what Ray said of the node is still said


def test_a_study_on_a_local_cluster_starts_it_lean(tmp_path: Path, polytrace_dir: Path) -> None:
    """`--ray local` starts its cluster as `toolenv serve --ray local` does (docs/ray.md): no
    dashboard, Ray's metrics pipeline and task events off. It ran the dashboard's processes
    (ten, here on 2 cores) and Ray's metrics beside the cells."""
    # a tag of its own: the two-node cluster of this module (`te<pid>`) is still up
    ns = NetnsCluster(workers=0, tag=f"tl{os.getpid() % 100000}").start(ray=False)
    try:
        argv = _study_argv(polytrace_dir, "--batch", "256", "--out", str(tmp_path / "out"),
                           "--ray", "local")  # fmt: skip
        env = {k: v for k, v in ns.env().items() if k not in CLUSTER_ENV}
        study = subprocess.Popen(ns.exec_argv(argv), env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)  # fmt: skip
        end = time.monotonic() + 120
        while not _ray_workers(ns, (0,)) and study.poll() is None and time.monotonic() < end:
            time.sleep(0.2)
        assert _ray_workers(ns, (0,)), "no cell started"
        names, raylet_env = [], b""
        for pid in ns.pids(0):
            with contextlib.suppress(OSError):
                names.append(name := Path(f"/proc/{pid}/comm").read_text().strip())
                if name == "raylet":
                    raylet_env = Path(f"/proc/{pid}/environ").read_bytes()
        study.send_signal(signal.SIGTERM)
        _, said = study.communicate(timeout=60)
        assert study.returncode == -signal.SIGTERM, said[-2000:]
        assert not [n for n in names if n.startswith("ray-dashboard")], names
        for key, value in CLUSTER_ENV.items():
            assert f"{key}={value}".encode() in raylet_env.split(b"\0"), key
        end = time.monotonic() + 30
        while ns.pids(0) and time.monotonic() < end:
            time.sleep(0.5)
        assert ns.pids(0) == []  # the cluster it started is stopped with it
    finally:
        ns.stop()
