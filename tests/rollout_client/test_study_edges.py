"""`toolenv rollout study` with odd but legal input: slow cells, an --out it cannot write, what
a study killed outright left there."""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

import pytest
from rollout_support import first_records, write_trace
from typer.testing import CliRunner

from rollout_client.engines.costmodel import load_cost_model
from rollout_client.study_report import ABANDONED_AFTER_S, STAGING
from toolenv.cli import build_app


def test_a_slow_cells_throughput_and_speed_up_keep_their_precision(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """Trajectories/s were rounded to 3 decimals and the speed-ups taken from them: cells of one
    trajectory on a slow engine read 0.002 traj/s and 1.00x, over-sampling that was slower
    included, and past 2,000 s a step, 0.0 traj/s and a speed-up of None, on which the report
    died (`unsupported format string passed to NoneType.__format__`, exit 1)."""
    profile = tmp_path / "slow.json"
    load_cost_model("searchr1-qwen7b").model_copy(update={"decode_base_s": 20.0}).save(profile)
    trace = write_trace(first_records(polytrace_dir, 8), tmp_path / "t.jsonl")
    args = ["rollout", "study", "--quick", "--trace", str(trace), "--batch", "1", "--steps", "1"]
    args += ["--cost-profile", str(profile), "--no-plots", "--out", str(tmp_path / "o")]
    done = CliRunner().invoke(build_app(), args)
    assert done.exit_code == 0, (done.output, done.exception)
    study = json.loads((tmp_path / "o" / "study.json").read_text())
    cells = {(c["scenario"], c["policy"]): c for c in study["cells"]}
    for (scenario, _), cell in cells.items():
        sync = cells[(scenario, "sync")]
        assert cell["trajectories_per_s"] > 0
        # one trajectory a step each: the speed-up is the ratio of the step makespans
        assert cell["speedup_over_sync"] == pytest.approx(
            sync["makespan_s"] / cell["makespan_s"], abs=0.002
        )
    slower = cells[("recorded", "overlap 25% carry")]
    assert slower["makespan_s"] > cells[("recorded", "sync")]["makespan_s"]
    assert slower["speedup_over_sync"] < 1
    md = (tmp_path / "o" / "study.md").read_text()
    # the first table's row (recorded): traj/s, then the speed-up
    row = next(x for x in md.splitlines() if x.startswith("| overlap 25% carry")).split(" | ")
    assert row[2] != "0.00" and row[3] == f"{slower['speedup_over_sync']:.2f}x"


def test_an_out_it_cannot_write_the_report_in_is_one_line_and_exit_2(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """A write that failed (a full disk; here a directory where a plot goes) was a traceback and
    exit 1, the status that says trajectories failed in a cell."""
    out = tmp_path / "o"
    (out / "pareto.png").mkdir(parents=True)
    trace = write_trace(first_records(polytrace_dir, 24), tmp_path / "t.jsonl")
    args = ["rollout", "study", "--quick", "--trace", str(trace), "--batch", "8", "--steps", "1"]
    done = CliRunner().invoke(build_app(), [*args, "--out", str(out)])
    assert done.exit_code == 2, (done.output, done.exception)
    assert (
        done.stderr.splitlines()[-1]
        == f"error: --out {out}: cannot write pareto.png: Is a directory"
    )
    assert "Traceback" not in done.output
    assert not [p for p in out.iterdir() if p.name.startswith(".study-")]


def test_the_staging_of_a_study_killed_outright_is_removed_by_the_next(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL while the report was staged left a hidden `.study-*` with its part of a report in
    --out, one per kill, for good. The next study removes it, never one a live study holds."""
    out = tmp_path / "o"
    killed, live, fresh = (out / f"{STAGING}{name}" for name in ("killed", "live", "fresh"))
    for staging in (killed, live, fresh):
        staging.mkdir(parents=True)
        (staging / "study.md").write_text("part of a report")
    old = time.time() - 2 * ABANDONED_AFTER_S
    for staging in (killed, live):
        os.utime(staging, (old, old))
    holder = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        trace = write_trace(first_records(polytrace_dir, 24), tmp_path / "t.jsonl")
        args = ["rollout", "study", "--quick", "--trace", str(trace), "--batch", "8"]
        args += ["--steps", "1", "--no-plots", "--out", str(out)]
        done = CliRunner().invoke(build_app(), args)
        assert done.exit_code == 0, (done.output, done.exception)
    finally:
        os.close(holder)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [live.name, fresh.name, "study.json", "study.md"]
    )
