"""Reports piped or redirected keep their full width (rich would cut cells at 80 columns), and
their counts agree with their nouns."""

from __future__ import annotations

import pytest
from rich.table import Table

from toolenv_core.console import REPORT_WIDTH, counted, report_console


def test_a_report_piped_gets_the_report_width_and_whole_cells(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    console = report_console()
    assert not console.is_terminal and console.width == REPORT_WIDTH
    table = Table()
    for name in ("file", "makespan recorded / simulated", "KS", "p50 / p90 engine latency"):
        table.add_column(name)
    table.add_row("multiturn_workload_step_2.jsonl", "435.4 / 434.2 s", "0.093", "79.1 / 80.3 s")
    console.print(table)
    out = capsys.readouterr().out
    assert "multiturn_workload_step_2.jsonl" in out and "…" not in out


def test_columns_still_decides_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "90")
    assert report_console().width == 90


@pytest.mark.parametrize(
    ("n", "noun", "plural", "said"),
    [
        (1, "step", None, "1 step"),
        (0, "step", None, "0 steps"),
        (2, "trajectory", None, "2 trajectories"),
        (1, "trajectory", None, "1 trajectory"),
        (3, "day", None, "3 days"),
        (2, "status", "statuses", "2 statuses"),
    ],
)
def test_a_count_agrees_with_its_noun(n: int, noun: str, plural: str | None, said: str) -> None:
    assert counted(n, noun, plural) == said
