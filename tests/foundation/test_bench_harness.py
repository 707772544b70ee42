"""The benchmarks' shared harness as a user meets it: a report path that cannot be written is
refused before the run (it failed in a traceback after minutes of work)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.harness import report_path

# every benchmark that writes a report, and the options naming its files
REPORTING = [
    ("benchmarks.sandboxd_bench", "--out"),
    ("benchmarks.fork_server_bench", "--out"),
    ("benchmarks.fork_server_budget", "--out"),
    ("benchmarks.fork_server_budget", "--png"),
    ("benchmarks.run_tests_budget", "--out"),
    ("benchmarks.emulators_bench", "--out"),
    ("benchmarks.gateway_bench", "--out"),
    ("benchmarks.stress_bench", "--out"),
    ("benchmarks.ray_bench", "--out"),
    ("benchmarks.rollout_virtual_bench", "--out"),
    ("benchmarks.docker_exec_bench", "--out"),
]


class _Parsed(Exception):
    """Raised once the arguments parsed: the benchmark itself never runs in these tests."""


@pytest.mark.parametrize(("module", "option"), REPORTING)
def test_an_unwritable_report_path_is_refused_before_the_run(
    module: str, option: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
        parse(self, *a, **k)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    argv = [option, "/proc/no-such-dir/report.json"]
    if option != "--out":
        argv += ["--out", "report.json"]
    monkeypatch.setattr(sys, "argv", [module, *argv])
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exited:
        main(argv) if inspect.signature(main).parameters else main()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: cannot write /proc/no-such-dir/report.json" in err


def test_report_path_says_what_is_wrong_and_makes_nothing(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory; give a file name"):
        report_path(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match="a-file is not a directory"):
        report_path(str(tmp_path / "a-file" / "r.json"))
    fresh = tmp_path / "new" / "deeper" / "r.json"
    assert report_path(str(fresh)) == fresh
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # made at write time
