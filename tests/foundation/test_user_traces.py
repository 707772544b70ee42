"""Traces a user recorded or edited by hand, read by every command that replays or fits them.

A trajectory the replay cannot run as written (no turn, a tool call after a turn it does not
have, one turn number twice) is one line naming the file, the line and the field, exit 2: each
was replayed with silently wrong figures (a zero-turn trajectory "completed" at time 0, a call
dropped from the replay but kept in the recorded timings, a turn's calls made twice)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from toolenv.cli import build_app

app = build_app()


def one_line_error(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def commands(path: Path, out: Path) -> list[list[str]]:
    """Every command that reads a user's multi-turn trace."""
    run = ["rollout", "run", "--engine", "sim", "--clock", "virtual", "--exact"]
    return [
        [*run, "--trace", str(path), "--batch", "4", "--no-plots", "--out", str(out / "run")],
        ["rollout", "validate", "--trace", str(path)],
        ["rollout", "study", "--trace", str(path), "--batch", "2", "--steps", "1", "--no-plots"]
        + ["--out", str(out / "study")],
        ["emulators", "fit", str(path)],
    ]


@pytest.fixture
def records(polytrace_dir: Path) -> list[dict]:
    with (polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl").open() as f:
        return [json.loads(next(f)) for _ in range(4)]


def write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_trajectory_without_turns_is_refused(records: list[dict], tmp_path: Path) -> None:
    """It replayed as a trajectory done at time 0 (`rollout run` counted it completed, `validate`
    put a 0 s completion into the KS), and its tool calls were dropped from the replay."""
    for calls in ([], records[0]["tool_calls"]):
        path = write(
            tmp_path / "trace.jsonl",
            [*records[:2], {**records[2], "turns": [], "tool_calls": calls}],
        )
        for command in commands(path, tmp_path):
            line = one_line_error(*command)
            assert line.startswith(f"error: {path}:3: field 'turns': ") and "no turn" in line, (
                command,
                line,
            )
