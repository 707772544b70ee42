"""`lock_if_still_there`: a lock counts only while its path still names the locked inode."""

from __future__ import annotations

import os
from pathlib import Path

from toolenv_core.flocks import lock_if_still_there


def test_a_lock_is_held_once_and_refused_to_a_second_holder(tmp_path: Path) -> None:
    path = tmp_path / "held"
    path.write_text("")
    first, second = os.open(path, os.O_RDONLY), os.open(path, os.O_RDONLY)
    try:
        assert lock_if_still_there(first, path, wait=False)
        assert not lock_if_still_there(second, path, wait=False)  # flock is per open file
    finally:
        os.close(first)
        os.close(second)


def test_a_path_reaped_or_replaced_before_the_lock_is_not_held(tmp_path: Path) -> None:
    path = tmp_path / "dir"
    path.mkdir()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        path.rmdir()  # a reaper took it between our open and our lock
        assert not lock_if_still_there(fd, path, wait=True)
        path.mkdir()  # and another instance made a new one under the same name
        assert not lock_if_still_there(fd, path, wait=False)
    finally:
        os.close(fd)
