"""Trace arguments a user gets wrong: a file that is not text, a directory, the wrong kind of
trace. Each is one clear line naming the file (and, for a wrong kind, what it looks like and which
option reads it), exit status 2, no traceback."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from typer.testing import CliRunner

from rollout_client.session import build_plans
from rollout_client.settings import RolloutSettings
from toolenv.cli import build_app

app = build_app()


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def one_line_error(result) -> str:
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_undecodable_file_is_named(polytrace_dir: Path, tmp_path: Path) -> None:
    binary = tmp_path / "weights.jsonl"
    binary.write_bytes(bytes(range(128, 256)) * 4)
    packed = tmp_path / "step_0.jsonl.gz"
    packed.write_bytes(
        gzip.compress((polytrace_dir / "search_r1/multiturn_workload_step_0.jsonl").read_bytes())
    )
    for command in (
        ["emulators", "fit", str(binary)],
        ["rollout", "run", "--trace", str(binary)],
        ["rollout", "run", "--synthetic", str(binary)],
        ["emulators", "describe", "search_default", "--data", str(binary)],
    ):
        line = one_line_error(cli(*command))
        assert f"{binary}:1: not UTF-8 text" in line, command
    line = one_line_error(cli("rollout", "run", "--trace", str(packed)))
    assert f"{packed}:1" in line and "gzip-compressed" in line and "gunzip" in line


def test_rollout_trace_accepts_a_directory(polytrace_dir: Path) -> None:
    """`--trace DIR` replays the directory's multi-turn files in step order, as `fit` reads them."""
    settings = RolloutSettings(limit=3000)
    steps = polytrace_dir / "search_r1"
    from_dir = [p.trajectory_id for p in build_plans(settings, [steps])]
    files = sorted(steps.glob("multiturn_workload_step_*.jsonl"))
    from_files = [p.trajectory_id for p in build_plans(settings, files)]
    assert from_dir == from_files and len(from_dir) == 3000  # step 0 (2,048), then step 1
    assert {p.source["step"] for p in build_plans(settings, [steps])} == {0, 1}


def test_directory_without_that_kind_says_what_it_holds(polytrace_dir: Path) -> None:
    line = one_line_error(cli("rollout", "run", "--trace", str(polytrace_dir / "rllm_deepcoder")))
    assert "holds no multi-turn trace" in line
    assert "reward timings" in line and "emulators fit --tool reward" in line
    assert "packed lengths" in line


def test_wrong_kind_says_what_it_looks_like_and_which_option_reads_it(polytrace_dir: Path) -> None:
    packed = polytrace_dir / "verl_dapo" / "packed_lengths_step_0.jsonl"
    line = one_line_error(cli("rollout", "run", "--trace", str(packed)))
    assert f"{packed}:1: this is not a multi-turn trace" in line
    assert "single-turn packed lengths" in line and "no command replays it" in line
    multiturn = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    line = one_line_error(cli("rollout", "run", "--synthetic", str(multiturn)))
    assert "this is not fitted intern_s1 parameters" in line and "rollout run --trace" in line
    params = polytrace_dir / "intern_s1" / "enhanced_task_distribution_parameters.json"
    line = one_line_error(cli("rollout", "run", "--trace", str(params)))
    assert "fitted intern_s1 parameters" in line and "rollout run --synthetic" in line
    timings = polytrace_dir / "rllm_deepcoder" / "reward_timings_step_0.jsonl"
    line = one_line_error(cli("emulators", "fit", str(timings)))  # --tool search by default
    assert "no calls of tool 'search'" in line and "--tool reward" in line


def test_another_json_document_is_not_taken_for_fitted_parameters(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """Any indented JSON (a rollout's report.json, a study's study.json) was said to be fitted
    intern_s1 parameters that `rollout run --synthetic` reads, which then refused it ("field
    'version': Field required"); a folder of them said it held such parameters."""
    report = tmp_path / "out" / "report.json"
    report.parent.mkdir()
    report.write_text(json.dumps({"policy": "async", "steps": [{"step": 0}]}, indent=2))
    said = f"{report}:1: a JSON document, not a PolyTrace file this project reads (one of: "
    for command in (
        ["rollout", "run", "--trace", str(report)],
        ["rollout", "validate", "--trace", str(report)],
        [
            "rollout",
            "study",
            "--trace",
            str(polytrace_dir / "search_r1"),
            "--reward-trace",
            str(report),
        ],
    ):
        line = one_line_error(cli(*command))
        assert line.startswith(f"error: {said}") and "intern_s1" not in line, command
    line = one_line_error(cli("rollout", "run", "--trace", str(report.parent)))
    assert line.endswith("1 file(s) like report.json: no PolyTrace kind this project reads")


def test_a_broken_first_record_of_the_right_kind_names_its_field(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    first = json.loads(
        (polytrace_dir / "search_r1/multiturn_workload_step_0.jsonl").open().readline()
    )
    del first["prompt_len"]
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(first) + "\n")
    line = one_line_error(cli("rollout", "run", "--trace", str(path)))
    assert f"{path}:1: field 'prompt_len'" in line and "looks like" not in line


def test_study_reads_trace_directories(polytrace_dir: Path) -> None:
    """`rollout study --reward-trace rllm_deepcoder` takes the directory's reward timings (its
    packed-lengths files are not reward timings and are left out)."""
    from rollout_client.study import reward_latencies

    folder = polytrace_dir / "rllm_deepcoder"
    files = sorted(folder.glob("reward_timings_step_*.jsonl"))
    assert list(reward_latencies([folder])) == list(reward_latencies(files))
    assert len(reward_latencies([folder])) == 10


def test_trace_replay_profile_names_cached_traces(polytrace_dir: Path, monkeypatch) -> None:
    """A `trace` latency spec's `paths` resolve like every trace argument (here the cache is the
    PolyTrace folder itself, so bare file names are looked up in it)."""
    from toolenv_core.latency.specs import TraceReplay
    from toolenv_core.polytrace import tool_latencies

    monkeypatch.setenv("TOOLENV_TRACES_CACHE_DIR", str(polytrace_dir))
    spec = TraceReplay(paths=["multiturn_workload_step_1.jsonl"])
    expected = tool_latencies([polytrace_dir / "search_r1" / "multiturn_workload_step_1.jsonl"])
    assert list(spec.values()) == list(expected) and expected.size > 3000


def test_an_empty_file_or_folder_says_so(tmp_path: Path) -> None:
    """An empty trace file read as 'not a PolyTrace file', a folder without trace files as
    "no calls of tool 'search' in : no files"."""
    empty, folder = tmp_path / "empty.jsonl", tmp_path / "folder"
    empty.write_text("\n")
    folder.mkdir()
    profile = "search_default"
    for command in (
        ["emulators", "fit", str(empty)],
        ["emulators", "describe", profile, "--data", str(empty)],
    ):
        assert one_line_error(cli(*command)) == f"error: {empty}: the file is empty", command
    for command in (
        ["emulators", "fit", str(folder)],
        ["emulators", "describe", profile, "--data", str(folder)],
    ):
        line = one_line_error(cli(*command))
        assert (
            line == f"error: no calls of tool 'search' in {folder}: no .jsonl or .log files there"
        )


def test_a_folder_of_fitted_parameters_says_what_it_holds(polytrace_dir: Path) -> None:
    """`emulators fit intern_s1` said "no .jsonl or .log files there" of a folder holding the
    fitted parameters (.json), which `rollout run --synthetic` reads."""
    folder = polytrace_dir / "intern_s1"
    for command in (
        ["emulators", "fit", str(folder)],
        ["emulators", "describe", "search_default", "--data", str(folder)],
    ):
        assert one_line_error(cli(*command)) == (
            f"error: no calls of tool 'search' in {folder}: 1 file(s) of fitted intern_s1 "
            "parameters: `toolenv rollout run --synthetic` reads it"
        ), command


def test_a_record_json_cannot_read_names_its_line(polytrace_dir: Path, tmp_path: Path) -> None:
    """An integer past Python's 4300-digit conversion limit, or nesting past its recursion limit,
    on a later line: a traceback before, not one line naming it."""
    first = (polytrace_dir / "search_r1/multiturn_workload_step_0.jsonl").open().readline()
    for bad, said in (
        ('{"step": ' + "9" * 5000 + "}", "an integer of more than 4300 digits"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ):
        path = tmp_path / "odd.jsonl"
        path.write_text(first + bad + "\n")
        for command in (["emulators", "fit", str(path)], ["rollout", "run", "--trace", str(path)]):
            line = one_line_error(cli(*command))
            assert line.startswith(f"error: {path}:2: JSON too large to read ({said})"), line


def test_a_trace_cut_short_says_where_its_json_breaks(polytrace_dir: Path, tmp_path: Path) -> None:
    """A download cut off mid-line ends in an unterminated string: the message read
    "(Unterminated string starting at at column 1577)"."""
    lines = (polytrace_dir / "search_r1/multiturn_workload_step_0.jsonl").open().readlines()[:2]
    path = tmp_path / "cut.jsonl"
    path.write_text(lines[0] + lines[1][: lines[1].index('"turns"') + 3])
    start = lines[1].index('"turns"') + 1  # the column where the cut string starts
    for command in (
        ["rollout", "run", "--trace", str(path)],
        ["rollout", "validate", "--trace", str(path)],
    ):
        line = one_line_error(cli(*command))
        assert (
            line
            == f"error: {path}:2: not valid JSON (Unterminated string starting at column {start})"
        ), line
    params = tmp_path / "params.json"
    params.write_text('{"a": "b')
    line = one_line_error(cli("rollout", "run", "--synthetic", str(params)))
    assert "(Unterminated string starting at column 7)" in line, line


def test_a_record_that_is_not_an_object_is_said_in_jsons_words(tmp_path: Path) -> None:
    """A line holding `null` or a list read "expected a JSON object, got NoneType" (or `list`):
    Python's type names, not what the file holds."""
    path = tmp_path / "odd.jsonl"
    for text, held in (
        ("null", "null"),
        ("[1]", "an array"),
        ('"x"', "a string"),
        ("3", "a number"),
    ):
        path.write_text(text + "\n")
        for workload in ("--trace", "--synthetic"):  # multi-turn records, fitted parameters
            line = one_line_error(cli("rollout", "run", workload, str(path)))
            assert line == f"error: {path}:1: expected a JSON object, got {held}", line


def test_a_trace_given_as_a_pipe_is_said_to_be_one(tmp_path: Path) -> None:
    """`emulators fit <(zcat calls.log.gz)` read the pipe's first lines to tell its kind, then
    opened it again for its calls and got what was left: a wrong "not valid JSON" or "no calls"
    about a trace that was fine."""
    profile = tmp_path / "p.yaml"
    profile.write_text("tool: search\nmodel: {kind: constant, value_s: 0.1}\n")
    log = b"".join(
        b"Step0, Request ID: %d, Tool: search, Latency: 0.%d seconds\n" % (i, i) for i in range(9)
    )
    for command in (["emulators", "fit"], ["emulators", "describe", str(profile), "--data"]):
        read, write = os.pipe()  # what bash's `<(...)` gives: /dev/fd/N, opened anew by name
        try:
            os.write(write, log)
            os.close(write)
            said = one_line_error(cli(*command, f"/dev/fd/{read}"))
        finally:
            os.close(read)
        assert said.startswith(f"error: /dev/fd/{read}: not a regular file (a pipe, "), said
        assert "`zcat TRACE.gz > TRACE.jsonl`" in said
