"""An flock that marks a path as someone's for as long as they hold it open.

Used where a path may be reaped by another process once nobody holds its lock (sandboxd's
per-instance run dirs, `traces fetch`'s `.part` files, a study's staging directory, a report's
temporary file): the reaper locks, then removes. Whoever
opened the path before the reap and locked after it holds a lock on something no longer there,
so a lock counts only if the path still names the locked inode.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path


def lock_if_still_there(fd: int, path: str | Path, *, wait: bool) -> bool:
    """Take an exclusive flock on `fd` (opened on `path`): True once held and `path` still names
    that inode; False if another process holds it (`wait=False`) or `path` was removed or
    replaced meanwhile. The caller closes `fd` either way."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    with contextlib.suppress(FileNotFoundError):
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    return False


def reap_unheld(
    paths: Iterable[Path], remove: Callable[[Path], None], *, older_than_s: float
) -> None:
    """`remove` each of `paths` nobody holds locked: what a writer killed outright (SIGKILL, a
    power cut) left behind for good. A path made a moment ago may not be locked yet by its
    writer, so one younger than `older_than_s` is left; so is one that vanishes meanwhile."""
    for path in paths:
        with contextlib.suppress(OSError):
            if time.time() - path.stat().st_mtime < older_than_s:
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                if lock_if_still_there(fd, path, wait=False):
                    remove(path)
            finally:
                os.close(fd)
