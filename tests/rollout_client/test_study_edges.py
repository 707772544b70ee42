"""`toolenv rollout study` with odd but legal input: slow cells, an --out it cannot write."""

from __future__ import annotations

from pathlib import Path

from rollout_support import first_records, write_trace
from typer.testing import CliRunner

from toolenv.cli import build_app


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
