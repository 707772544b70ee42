"""`toolenv rollout study --ray ADDRESS` on a cluster where no node has a CPU for a cell (a head
started with `--num-cpus 0`, as clusters often run their head), in a network namespace of its
own."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from toolenv.ray.netns import NetnsCluster

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
