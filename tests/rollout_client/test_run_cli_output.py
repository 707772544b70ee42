"""`toolenv rollout run` as a user meets it: what it refuses up front and what it leaves in --out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rollout_client.workloads.plan import MAX_CONTEXT_TOKENS

REPO_ROOT = Path(__file__).resolve().parents[2]


def rollout_run(polytrace_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    cmd = [
        sys.executable, "-m", "toolenv", "rollout", "run", "--engine", "sim", "--clock",
        "virtual", "--exact", "--trace", str(trace), "--out", str(out), *args,
    ]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def test_a_length_scale_past_what_a_trajectory_holds_is_refused_before_the_run(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """--length-scale 1e9 died in a MemoryError (a traceback, exit 1) building the first prompt's
    token list; a scale whose trajectories fit still runs."""
    small = ("--limit", "2", "--batch", "2", "--no-plots")
    done = rollout_run(polytrace_dir, tmp_path / "big", *small, "--length-scale", "1e9")
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: trajectory ") and "Traceback" not in done.stderr
    assert f"a trajectory holds at most {MAX_CONTEXT_TOKENS:,}" in line
    assert "lower --length-scale" in line
    assert not (tmp_path / "big").exists()
    done = rollout_run(polytrace_dir, tmp_path / "fits", *small, "--length-scale", "20", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["summary"]["completed"] == 2
