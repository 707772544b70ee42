"""The one check every command makes of the paths it will write, before its work."""

from __future__ import annotations

import errno
import fcntl
import os
import time
from pathlib import Path

import pytest

from toolenv_core.outputs import (
    ABANDONED_AFTER_S,
    output_dir_problem,
    output_file_problem,
    write_whole,
    written_whole,
)


@pytest.mark.parametrize("make_parents", [False, True])
def test_an_output_file_problem_is_said_before_anything_is_made(
    tmp_path: Path, make_parents: bool
) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    check = lambda p: output_file_problem(p, make_parents=make_parents)  # noqa: E731
    assert check(tmp_path / "out.json") is None
    assert check(tmp_path) == "is a directory; name a file"
    assert check(blocker / "out.json") == f"{blocker} is a file, not a directory"
    assert check(tmp_path / ("p" * 300)) == "cannot write: File name too long"
    assert check(Path("/proc/out.json")).startswith("cannot write in /proc: ")
    missing = tmp_path / "a" / "b" / "out.json"
    if make_parents:
        assert check(missing) is None and check(blocker / "d" / "out.json") == (
            f"{blocker} is a file, not a directory"
        )
    else:
        assert check(missing) == f"there is no directory {missing.parent}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker"]  # nothing made or left


def test_an_output_dir_problem_is_said_before_anything_is_made(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    assert output_dir_problem(tmp_path / "a" / "b") is None
    assert output_dir_problem(blocker) == "is a file, not a directory"
    assert output_dir_problem(blocker / "d") == f"{blocker} is a file, not a directory"
    assert output_dir_problem(tmp_path / ("d" * 300)) == (
        "cannot make the directory: File name too long"
    )
    assert output_dir_problem(Path("/proc/plots")).startswith("cannot write in /proc: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocker"]


def test_a_write_cut_short_leaves_the_file_that_was_there(tmp_path: Path) -> None:
    """A report written in place and cut short (a full disk) was no longer the earlier one nor
    the new one; the error of a write into the temporary file names the report."""
    report = tmp_path / "report.json"
    report.write_text("earlier\n")
    with pytest.raises(OSError) as failed, written_whole(report) as f:
        f.write("half of a new rep")
        f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert failed.value.filename == str(report)
    assert report.read_text() == "earlier\n"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
    write_whole(report, "new\n")
    assert report.read_text() == "new\n" and oct(report.stat().st_mode & 0o777) == "0o644"


def test_the_temporary_file_of_a_write_killed_outright_is_removed_by_the_next(
    tmp_path: Path,
) -> None:
    """SIGKILL mid-write (a `rollout run`'s report.json, a stress --json) left a hidden
    `.report.json.*.tmp` beside the report for good, one per kill. The next write of the same
    file removes those nobody holds; a live write's (locked), a fresh one and another file's stay."""
    report = tmp_path / "report.json"
    killed, live, fresh, other = (
        tmp_path / name
        for name in (".report.json.a.tmp", ".report.json.b.tmp", ".report.json.c.tmp",
                     ".trajectories.jsonl.d.tmp")
    )  # fmt: skip
    old = time.time() - 2 * ABANDONED_AFTER_S
    for tmp in (killed, live, fresh, other):
        tmp.write_text("{half a rep")
        if tmp is not fresh:
            os.utime(tmp, (old, old))
    holder = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        write_whole(report, "{}")
    finally:
        os.close(holder)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [report.name, live.name, fresh.name, other.name]
    )


def test_a_write_in_progress_holds_its_temporary_file(tmp_path: Path) -> None:
    """So that another process's reap never takes a write that is still going on."""
    with written_whole(tmp_path / "r.json") as f:
        f.write("{")
        (tmp,) = tmp_path.glob(".r.json.*.tmp")
        fd = os.open(tmp, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        f.write("}")
    assert (tmp_path / "r.json").read_text() == "{}"
