"""The virtual clock far from 0: timers still fire up to the horizon, where the run ends in a
message. Each case runs in a child with a timeout: the bug was a run that never ended."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rollout_support import first_records, write_trace

REPO_ROOT = Path(__file__).resolve().parents[2]

SLEEPS = """
import asyncio
from rollout_client.clock import run_virtual

async def main(first):
    await asyncio.sleep(first)
    await asyncio.sleep(0.5)
    return asyncio.get_running_loop().time()

print([run_virtual(main(first)) for first in (1e6, 2e7, 1e8, 5e8)])
"""


def test_timers_fire_past_a_float_step_of_two_nanoseconds() -> None:
    """Past about 1.7e7 s (half a year) of virtual time `now + 1 ns` rounded to `now`, asyncio
    never ran a timer due now, and the clock never moved again: the run spun for ever at 100%
    CPU, well before the 1e9 s horizon that ends a run with a message."""
    done = subprocess.run(
        [sys.executable, "-c", SLEEPS], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [1e6 + 0.5, 2e7 + 0.5, 1e8 + 0.5, 5e8 + 0.5]


def test_a_study_of_a_call_recorded_at_12_days_ends(polytrace_dir: Path, tmp_path: Path) -> None:
    """One call recorded at 1e6 s ran in the recorded and x10 scenarios and spun for ever at
    x100 (1e8 s)."""
    records = first_records(polytrace_dir, 24)
    records[0]["tool_calls"][0]["latency_s"] = 1e6
    trace = write_trace(records, tmp_path / "t.jsonl")
    cmd = [
        sys.executable, "-m", "toolenv", "rollout", "study", "--quick", "--trace", str(trace),
        "--batch", "8", "--steps", "1", "--no-plots", "--out", str(tmp_path / "o"), "--json",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    cells = {(c["scenario"], c["policy"]): c for c in json.loads(done.stdout)["cells"]}
    assert cells[("x100", "async")]["makespan_s"] > 1e8  # the call waited out, x100
    assert all(c["failed"] == 0 for c in cells.values())
