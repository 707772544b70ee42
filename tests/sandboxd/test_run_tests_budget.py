"""The run_tests budget's ratio and 5x target, on made-up per-case figures."""

from __future__ import annotations

from benchmarks.cpu_budget import LOADGEN
from benchmarks.run_tests_budget import floor


def test_floor_ratios_and_5x_target() -> None:
    fork = {"wall_ms_per_case": 2.0, "ours_ms_per_run": 3.0, "ms_per_run": {LOADGEN: 0.5}}
    warm = {"wall_ms_per_case": 8.0, "ours_ms_per_run": 13.5, "ms_per_run": {LOADGEN: 0.6}}
    out = floor(fork, warm)
    assert out["ratio_wall"] == 4.0
    assert out["ratio_by_cpu"] == 4.5
    assert out["fork_ms_per_case_without_load_generator"] == 2.5
    assert out["target_ms_per_case_5x_from_cpu"] == 2.7
