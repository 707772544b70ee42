"""`make bench ARGS=...` (benchmarks/run.py): a word that names no benchmark is refused before
anything runs; it ran nothing, printed `{}` and exited 0, as if every benchmark had passed."""

from __future__ import annotations

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
