"""An flock that marks a path as someone's for as long as they hold it open.

Used where a path may be reaped by another process once nobody holds its lock (sandboxd's
per-instance run dirs, `traces fetch`'s `.part` files): the reaper locks, then removes. Whoever
opened the path before the reap and locked after it holds a lock on something no longer there,
so a lock counts only if the path still names the locked inode.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
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
