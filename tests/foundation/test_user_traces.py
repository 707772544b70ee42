"""Traces a user recorded or edited by hand, read by every command that replays or fits them.

A trajectory the replay cannot run as written (no turn, a tool call after a turn it does not
have, one turn number twice) is one line naming the file, the line and the field, exit 2: each
was replayed with silently wrong figures (a zero-turn trajectory "completed" at time 0, a call
dropped from the replay but kept in the recorded timings, a turn's calls made twice). A file
without a trajectory is named; an editor's byte order mark is read past."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from toolenv.cli import build_app
from toolenv_core.latency.profile import load_profile

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


def test_a_tool_call_after_a_turn_the_trajectory_lacks_is_refused(
    records: list[dict], tmp_path: Path
) -> None:
    """A call at turn 7 of a two-turn trajectory (or at turn 2 of turns 0, 1, 3) was dropped from
    the replay, while `validate` kept its latency in the recorded completion time."""
    first = records[0]
    assert [t["turn"] for t in first["turns"]] == [0, 1]
    late = {**first, "tool_calls": [*first["tool_calls"], {**first["tool_calls"][0], "turn": 7}]}
    gap = {
        **first,
        "turns": [*first["turns"], {**first["turns"][1], "turn": 3}],
        "tool_calls": [*first["tool_calls"], {**first["tool_calls"][0], "turn": 2}],
    }
    for record, turns in ((late, "0, 1"), (gap, "0, 1, 3")):
        path = write(tmp_path / "trace.jsonl", [*records[1:], record])
        n = len(record["tool_calls"]) - 1
        for command in commands(path, tmp_path):
            line = one_line_error(*command)
            assert line.startswith(f"error: {path}:4: field 'tool_calls.{n}.turn': "), line
            assert f"(its turns: {turns})" in line, line


def test_turns_numbered_with_gaps_replay_in_order(records: list[dict], tmp_path: Path) -> None:
    """A capture's X-Turn may start at 1 or skip a number: each turn is replayed once, in order
    of its number, with the calls made after it (the run's own records number them from 0)."""
    first = records[0]
    renumbered = {
        **first,
        "turns": [{**t, "turn": 2 * t["turn"] + 1} for t in first["turns"]],
        "tool_calls": [{**c, "turn": 2 * c["turn"] + 1} for c in first["tool_calls"]],
    }
    out = tmp_path / "out"
    for name, record in (("as_recorded", first), ("renumbered", renumbered)):
        path = write(tmp_path / f"{name}.jsonl", [record])
        result = CliRunner().invoke(app, commands(path, out / name)[0])
        assert result.exit_code == 0, result.output
    ran = [
        json.loads((out / name / "run" / "trajectories.jsonl").read_text())
        for name in ("as_recorded", "renumbered")
    ]
    assert [t["turn"] for t in ran[1]["turns"]] == [0, 1]
    assert [c["turn"] for c in ran[1]["tool_calls"]] == [c["turn"] for c in first["tool_calls"]]
    assert ran[0]["turns"] == ran[1]["turns"]


def test_a_turn_number_given_twice_is_refused(records: list[dict], tmp_path: Path) -> None:
    """Both turns were replayed, each followed by every call of that number: the calls ran
    twice (a trajectory with one call recorded replayed two)."""
    first = records[0]
    twice = {**first, "turns": [*first["turns"], first["turns"][0]]}
    path = write(tmp_path / "trace.jsonl", [twice, *records[1:]])
    for command in commands(path, tmp_path):
        line = one_line_error(*command)
        assert line.startswith(f"error: {path}:1: field 'turns.2.turn': "), line
        assert "turn 0 is given twice (turns.0 and turns.2)" in line, line


@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_an_empty_trace_file_is_named(records: list[dict], tmp_path: Path, text: str) -> None:
    """`rollout run` said "the trace selection is empty" without naming the file, `study` "the
    traces hold 0 trajectories"; given beside a trace that has some, it was read as nothing."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text(text)
    good = write(tmp_path / "good.jsonl", records)
    for command in commands(empty, tmp_path)[:3]:  # `emulators fit`: "the file is empty"
        assert one_line_error(*command) == f"error: {empty}: holds no trajectories", command
    run = commands(good, tmp_path)[0]
    assert one_line_error(*run, "--trace", str(empty)) == f"error: {empty}: holds no trajectories"


@pytest.mark.parametrize("text", ["", "\n  \n\n"])
def test_an_empty_reward_trace_is_named(
    records: list[dict], polytrace_dir: Path, tmp_path: Path, text: str
) -> None:
    """`rollout study --reward-trace EMPTY` said "no reward timings in --reward-trace" without
    naming the file (an empty `--trace` is named); beside another reward trace it was read as
    nothing."""
    empty = tmp_path / "reward_timings_step_9.jsonl"
    empty.write_text(text)
    good = polytrace_dir / "rllm_deepcoder" / "reward_timings_step_0.jsonl"
    study = commands(write(tmp_path / "good.jsonl", records), tmp_path)[2]
    for rewards in ([empty], [good, empty]):
        given = [arg for path in rewards for arg in ("--reward-trace", str(path))]
        assert one_line_error(*study, *given) == f"error: {empty}: holds no reward timings"


def test_a_trace_given_twice_is_noted(
    records: list[dict], polytrace_dir: Path, tmp_path: Path
) -> None:
    """`--trace DIR --trace DIR/FILE` (or one file twice) replayed the file twice, silently, in
    `rollout run` and `rollout study`; a repeated `--reward-trace` counted its timings twice, and
    `emulators fit FILE DIR` fitted its calls twice. Each is a note naming the file (a file given
    twice may be meant): the run goes on."""
    folder = tmp_path / "steps"
    folder.mkdir()
    good = write(folder / "multiturn_workload_step_0.jsonl", records)
    reward = polytrace_dir / "rllm_deepcoder" / "reward_timings_step_0.jsonl"
    run, _, study, _ = commands(good, tmp_path)
    said = f"note: {good} is given twice (--trace): its trajectories are in the selection twice\n"
    for command in (run, study):
        result = CliRunner().invoke(app, [*command, "--trace", str(folder)])
        assert result.exit_code == 0, (result.output, result.exception)
        assert said in result.stderr, result.stderr
        once = CliRunner().invoke(app, command)
        assert once.exit_code == 0 and "is given" not in once.stderr
    result = CliRunner().invoke(
        app, [*study, "--reward-trace", str(reward), "--reward-trace", str(reward)]
    )
    assert result.exit_code == 0, (result.output, result.exception)
    assert (
        f"note: {reward} is given twice (--reward-trace): its timings are counted twice\n"
        in result.stderr
    )
    assert "--trace): " not in result.stderr  # the trace was given once
    fit = CliRunner().invoke(app, ["emulators", "fit", str(good), str(folder), "--json"])
    assert fit.exit_code == 0, (fit.output, fit.exception)
    assert f"note: {good} is given twice (TRACE): its calls are fitted twice\n" in fit.stderr


def test_a_trace_saved_with_a_byte_order_mark_reads_as_without(
    records: list[dict], tmp_path: Path
) -> None:
    """An editor's UTF-8 byte order mark (Notepad writes one) was "not valid JSON (Unexpected UTF-8
    BOM (decode using utf-8-sig) at column 1)" from every reader."""
    plain = write(tmp_path / "plain.jsonl", records)
    marked = tmp_path / "marked.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    for command in (commands(marked, tmp_path / "m")[1], commands(marked, tmp_path / "m")[3]):
        assert CliRunner().invoke(app, command).exit_code == 0, command
    done = [
        CliRunner().invoke(app, [*commands(path, tmp_path / path.stem)[0], "--json"])
        for path in (plain, marked)
    ]
    assert [d.exit_code for d in done] == [0, 0], done[1].output
    assert json.loads(done[0].stdout)["steps"] == json.loads(done[1].stdout)["steps"]


def test_a_folder_of_captures_says_it_holds_captures(tmp_path: Path) -> None:
    """`trace_path: traces/capture.jsonl` (docs/gateway.md), then `--trace traces`: it said the
    folder held "no PolyTrace kind this project reads", nothing about converting the capture."""
    folder = tmp_path / "traces"
    folder.mkdir()
    call = {"turn": 0, "tool_name": "search", "latency_s": 0.1, "trajectory_id": "t", "step": 0}
    write(folder / "capture.jsonl", [call])
    for command in commands(folder, tmp_path)[:3]:
        line = one_line_error(*command)
        assert line.startswith(
            f"error: {folder}: holds no multi-turn trace; it holds 1 file(s) "
        ), line
        assert "like capture.jsonl: a gateway trace capture" in line, line
        assert "`toolenv gateway trace-to-multiturn CAPTURE OUT.jsonl`" in line, line


def test_fit_of_a_folder_reads_the_conversion_beside_its_capture(tmp_path: Path) -> None:
    """A folder holding the capture and the trace made of it: `emulators fit traces` failed on the
    capture, asking to convert it (done, beside it), while `rollout run --trace traces` read the
    conversion. A capture named as a file is still refused, with that advice."""
    folder = tmp_path / "traces"
    folder.mkdir()
    calls = [
        {"turn": 0, "tool_name": "search", "latency_s": s, "trajectory_id": f"t{i}", "step": 0}
        for i, s in enumerate([0.1, 0.2, 0.4, 0.3, 0.5, 0.25, 0.15, 0.35])
    ]
    capture = write(folder / "capture.jsonl", calls)
    describe = ["emulators", "describe", "search_default", "--data"]
    for command in (["emulators", "fit"], describe):  # only a capture there: says what it is
        line = one_line_error(*command, str(folder))
        assert "1 file(s) of a gateway trace capture: `toolenv gateway trace-to-multiturn" in line
    converted = CliRunner().invoke(
        app, ["gateway", "trace-to-multiturn", str(capture), str(folder / "multiturn.jsonl")]
    )
    assert converted.exit_code == 0, converted.output
    fitted = CliRunner().invoke(app, ["emulators", "fit", str(folder), "--json"])
    assert fitted.exit_code == 0, fitted.output
    assert json.loads(fitted.stdout)["n"] == len(calls)
    assert CliRunner().invoke(app, [*describe, str(folder)]).exit_code == 0
    assert "a gateway trace capture" in one_line_error("emulators", "fit", str(capture))


def test_a_profile_fitted_on_a_file_here_names_its_folder(
    records: list[dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`emulators fit trace.jsonl` from the trace's folder wrote `source: PolyTrace /trace.jsonl`,
    a path at the root of the file system."""
    write(tmp_path / "trace.jsonl", records)
    monkeypatch.chdir(tmp_path)
    fitted = CliRunner().invoke(app, ["emulators", "fit", "trace.jsonl", "--out", "p.yaml"])
    assert fitted.exit_code == 0, fitted.output
    assert load_profile(tmp_path / "p.yaml").source == f"PolyTrace {tmp_path.name}/trace.jsonl"
