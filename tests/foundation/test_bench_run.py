"""`make bench ARGS=...` (benchmarks/run.py): a word that names no benchmark is refused before
anything runs; it ran nothing, printed `{}` and exited 0, as if every benchmark had passed."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks import run
from benchmarks.run import main

REPO_ROOT = Path(__file__).resolve().parents[2]


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


def test_an_out_dir_that_cannot_be_made_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit) as exited:
        main(["stress", "--out-dir", str(tmp_path / "a-file")])
    assert exited.value.code == 2
    assert f"argument --out-dir: cannot make {tmp_path / 'a-file'}: File exists" in (
        capsys.readouterr().err
    )


def test_a_benchmark_that_writes_no_report_is_not_named_by_an_earlier_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run whose benchmark failed before writing its report named the file an earlier run
    had left there as this run's `report`: its figures read as the new run's."""
    out_dir = tmp_path / "bench-results"
    out_dir.mkdir()
    stale = out_dir / "benchmarks.stress_bench.json"
    stale.write_text('{"figures": "of an earlier run"}\n')
    stale_plot = out_dir / "benchmarks.stress_bench.png"  # emulators_bench and ray_bench plot
    stale_plot.write_bytes(b"an earlier run's plot")
    monkeypatch.setattr(run, "run_one", lambda cmd: 2)  # it exits before writing anything
    assert main(["stress", "--out-dir", str(out_dir)]) == 1
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["benchmarks.stress_bench"]["exit_code"] == 2
    assert summary["benchmarks.stress_bench"]["report"] is None and not stale.exists()
    assert not stale_plot.exists()


FAKE_BENCH = """
import pathlib, sys, time
here = pathlib.Path(sys.argv[0]).parent
(here / "started").write_text("")
try:
    time.sleep(60)
except KeyboardInterrupt:
    time.sleep(1.5)  # stopping the servers it started
    (here / "stopped").write_text("")
    raise
"""

DRIVER = """
import sys
from benchmarks import run
run.BENCHMARK_MODULES = ["fake_bench"]
raise SystemExit(run.main(["fake", "--out-dir", sys.argv[1]]))
"""


def test_ctrl_c_lets_the_running_benchmark_stop_what_it_started(tmp_path: Path) -> None:
    """Ctrl-C in `make bench`: the runner killed the benchmark 0.25 s later (`subprocess.call`),
    half-way through stopping its servers, which ran on in their own sessions."""
    (tmp_path / "fake_bench.py").write_text(FAKE_BENCH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(tmp_path)])}
    runner = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(tmp_path / "out")],
        cwd=tmp_path,
        env=env,
        process_group=0,  # as a terminal's foreground group: Ctrl-C signals every process in it
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        give_up = time.monotonic() + 30
        while not (tmp_path / "started").exists() and time.monotonic() < give_up:
            time.sleep(0.05)
        assert (tmp_path / "started").exists()
        os.killpg(runner.pid, signal.SIGINT)
        assert runner.wait(30) != 0
        assert (tmp_path / "stopped").exists(), "the benchmark was killed while it stopped"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(runner.pid, signal.SIGKILL)
        runner.wait()


@pytest.mark.parametrize("module", run.BENCHMARK_MODULES)
def test_every_benchmark_takes_the_arguments_the_runner_gives(
    module: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make bench ARGS=--quick` gives each benchmark `--out FILE --quick`: ray_bench had no
    `--quick` and exited 2 at once, `report: null`."""
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
        parse(self, *a, **k)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    argv = ["--out", str(tmp_path / f"{module}.json"), "--quick"]
    monkeypatch.setattr(sys, "argv", [module, *argv])
    main = importlib.import_module(module).main
    with pytest.raises(_Parsed):
        main(argv) if inspect.signature(main).parameters else main()


class _Parsed(Exception):
    """Raised once the arguments parsed: the benchmark itself never runs here."""
