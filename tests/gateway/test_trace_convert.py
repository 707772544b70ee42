"""`toolenv gateway trace-to-multiturn`: a capture converted, and each file it refuses."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading

import pytest
from typer.testing import CliRunner

from toolenv.cli import build_app
from toolenv_core.polytrace.multiturn import read_multiturn

toolenv_app = build_app()


_CALL = '{"turn": 0, "tool_name": "search", "latency_s": 0.1, "trajectory_id": "t"%s}\n'


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("root:x:0:0:root:/root:/bin/bash\n", ":1: not valid JSON (Expecting value at column 1)"),
        ('{"tool_name": "search"}\n', ":1: field 'turn': Field required"),
        # a published trace's tool call: with others, grouped into one trajectory named ""
        (_CALL.replace(', "trajectory_id": "t"', "") % "", ":1: field 'trajectory_id': Field"),
        ('{"step": 0, "prompt_len": 5, "turns": []}\n', ":1: a PolyTrace multi-turn trajectory"),
        # each of these three was a traceback: a negative step (refused only when the trajectory
        # was built), an integer past Python's 4300-digit conversion limit, deep nesting
        (_CALL % ', "step": -1', ":1: field 'step': Input should be greater than or equal to 0"),
        (_CALL % (', "step": ' + "9" * 5000), ":1: JSON too large to read (an integer of more"),
        ("[" * 100_000 + "]" * 100_000 + "\n", ":1: JSON too large to read (nested too deeply)"),
    ],
)
def test_a_file_that_is_not_a_capture_is_one_line_and_exit_2(tmp_path, text, said) -> None:
    capture, out = tmp_path / "capture.jsonl", tmp_path / "out.jsonl"
    capture.write_text(text)
    args = ["gateway", "trace-to-multiturn", str(capture), str(out)]
    result = CliRunner().invoke(toolenv_app, args)
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr.startswith(f"error: {capture}{said}"), result.stderr
    assert result.stderr.count("\n") == 1 and not out.exists()


def test_a_torn_last_line_is_left_out_and_named(tmp_path) -> None:
    """A gateway killed while it wrote a batch leaves half a line at the end: the whole capture
    was refused for it ("not valid JSON"), every call before it lost to the conversion."""
    capture, out = tmp_path / "capture.jsonl", tmp_path / "out.jsonl"
    line = _CALL % ', "step": 3'
    capture.write_text(line + line + line[: len(line) // 2])
    args = ["gateway", "trace-to-multiturn", str(capture), str(out)]
    result = CliRunner().invoke(toolenv_app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    assert result.stderr == (
        f"warning: {capture}:3 stops mid-record (the gateway was stopped while writing it): "
        "that call is left out\n"
    )
    (trajectory,) = read_multiturn(out)
    assert trajectory.tool_call_count == 2
    capture.write_text(line[: len(line) // 2] + "\n" + line)  # torn inside: still refused
    result = CliRunner().invoke(toolenv_app, args)
    assert result.exit_code == 2 and result.stderr.startswith(f"error: {capture}:1: not valid")


def test_a_dash_writes_the_trajectories_to_stdout(tmp_path, monkeypatch) -> None:
    """`trace-to-multiturn CAPTURE -` wrote a file named "-" in the working directory."""
    capture = tmp_path / "capture.jsonl"
    capture.write_text(_CALL % ', "step": 3' + _CALL % ', "step": 4')
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(toolenv_app, ["gateway", "trace-to-multiturn", str(capture), "-"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert [json.loads(line)["step"] for line in result.stdout.splitlines()] == [3, 4]
    assert result.stderr == "wrote 2 trajectories to standard output\n"
    assert not (tmp_path / "-").exists()


def test_a_gzip_compressed_capture_says_so_and_names_its_line(tmp_path) -> None:
    """It said "not UTF-8 text" with no line and no cause, where every trace reader says the
    file is gzip-compressed (the same loop reads a capture now)."""
    capture, out = tmp_path / "capture.jsonl.gz", tmp_path / "out.jsonl"
    capture.write_bytes(gzip.compress((_CALL % "").encode()))
    result = CliRunner().invoke(
        toolenv_app, ["gateway", "trace-to-multiturn", str(capture), str(out)]
    )
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr.startswith(f"error: {capture}:1: not UTF-8 text (byte 0x8b")
    assert "gzip-compressed" in result.stderr and result.stderr.count("\n") == 1
    assert not out.exists()


@pytest.mark.parametrize("where", ["missing/out.jsonl", "."])
def test_an_output_that_cannot_be_written_says_so(tmp_path, where) -> None:
    """It said "error: [Errno 2] No such file or directory: 'missing/out.jsonl'"."""
    capture, out = tmp_path / "capture.jsonl", tmp_path / where
    capture.write_text(_CALL % "")
    result = CliRunner().invoke(
        toolenv_app, ["gateway", "trace-to-multiturn", str(capture), str(out)]
    )
    assert result.exit_code == 2, (result.output, result.exception)
    why = "No such file or directory" if where != "." else "Is a directory"
    assert result.stderr == f"error: cannot write the trace to {out}: {why}\n"


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_a_capture_without_calls_is_refused_and_writes_nothing(tmp_path, text) -> None:
    """It wrote an empty trace and said "wrote 0 trajectories", exit 0: every command given that
    trace then said it was empty, with nothing about why."""
    capture, out = tmp_path / "capture.jsonl", tmp_path / "out.jsonl"
    capture.write_text(text)
    result = CliRunner().invoke(
        toolenv_app, ["gateway", "trace-to-multiturn", str(capture), str(out)]
    )
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stderr == (
        f"error: {capture}: holds no tool calls (the gateway records each call that carries "
        "X-Trajectory-Id)\n"
    )
    assert not out.exists()


def test_a_directory_given_as_the_capture_says_so(tmp_path) -> None:
    args = ["gateway", "trace-to-multiturn", str(tmp_path), str(tmp_path / "out.jsonl")]
    result = CliRunner().invoke(toolenv_app, args)
    assert result.exit_code == 2  # it said "does not exist"
    assert result.stderr == f"error: {tmp_path} is a directory; name the capture file\n"


def test_the_capture_as_its_own_output_is_refused_and_kept(tmp_path) -> None:
    """Before: `trace-to-multiturn capture.jsonl capture.jsonl` overwrote the capture."""
    capture = tmp_path / "capture.jsonl"
    text = _CALL % ', "step": 1'
    capture.write_text(text)
    (tmp_path / "link.jsonl").symlink_to(capture)
    for out in (capture, tmp_path / "link.jsonl", tmp_path / "." / "capture.jsonl"):
        args = ["gateway", "trace-to-multiturn", str(capture), str(out)]
        result = CliRunner().invoke(toolenv_app, args)
        assert result.exit_code == 2, (result.output, result.exception)
        assert result.stderr == f"error: {out} is the capture itself; name another file to write\n"
    assert capture.read_text() == text


def test_a_capture_read_from_a_pipe_converts(tmp_path) -> None:
    """`trace-to-multiturn <(zcat capture.jsonl.gz) out.jsonl`: a pipe is no regular file, and it
    said "does not exist"."""
    fifo, out = tmp_path / "capture.fifo", tmp_path / "out.jsonl"
    os.mkfifo(fifo)
    line = _CALL % ', "step": 3'

    def feed() -> None:
        with fifo.open("w") as handle:  # blocks until the command opens it to read
            handle.write(line + line)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    args = ["gateway", "trace-to-multiturn", str(fifo), str(out)]
    result = CliRunner().invoke(toolenv_app, args)
    if writer.is_alive():  # the command never opened it: let the writer go
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    writer.join(10)
    assert result.exit_code == 0, (result.output, result.exception)
    (trajectory,) = read_multiturn(out)
    assert trajectory.step == 3 and trajectory.tool_call_count == 2
    assert result.stdout == f"wrote 1 trajectory to {out}\n"  # it said "1 trajectories"


def test_a_reader_that_stops_early_ends_it_quietly(tmp_path) -> None:
    """`trace-to-multiturn CAPTURE - | head` said "error: cannot write the trace to -: Broken
    pipe" (exit 2), as if the output were the user's mistake; a pipe's reader may stop early."""
    capture = tmp_path / "capture.jsonl"
    with capture.open("w") as f:  # far more than a pipe holds before its reader takes any
        for n in range(3000):
            f.write(_CALL.replace('"t"', f'"t{n}"') % ', "step": 0')
    command = subprocess.Popen(
        [sys.executable, "-m", "toolenv", "gateway", "trace-to-multiturn", str(capture), "-"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert command.stdout is not None and command.stderr is not None
    command.stdout.read(100)
    command.stdout.close()  # what `head -c 100` does once it has its bytes
    said = command.stderr.read()
    assert command.wait(timeout=60) == 1
    assert said == b"", said
