"""`make bench ARGS=...` (benchmarks/run.py): a word that names no benchmark is refused before
anything runs; it ran nothing, printed `{}` and exited 0, as if every benchmark had passed."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks.run import main


def test_a_word_that_names_no_benchmark_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "bench-results"
    with pytest.raises(SystemExit) as exited:
        main(["gatway", "--out-dir", str(out_dir)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "no benchmark starts with gatway" in err and "gateway_bench" in err
    assert not out_dir.exists()  # no summary.json claiming a run


def test_a_benchmark_that_writes_no_report_is_not_named_by_an_earlier_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose benchmark failed before writing its report named the file an earlier run
    had left there as this run's `report`: its figures read as the new run's."""
    out_dir = tmp_path / "bench-results"
    out_dir.mkdir()
    stale = out_dir / "benchmarks.stress_bench.json"
    stale.write_text('{"figures": "of an earlier run"}\n')
    monkeypatch.setattr(subprocess, "call", lambda cmd: 2)  # it exits before writing anything
    assert main(["stress", "--out-dir", str(out_dir)]) == 1
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["benchmarks.stress_bench"]["exit_code"] == 2
    assert summary["benchmarks.stress_bench"]["report"] is None and not stale.exists()
