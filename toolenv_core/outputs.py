"""Output paths a command will write, checked before the work that makes them.

Every CLI that writes a report, a profile or a plot checks its paths here first: a path found bad
after minutes of fitting or replaying lost that work, and each command had spelled its own check
(one made missing directories, one refused them, one never tried to write there). A problem reads
as the tail of a `--option PATH: ...` message. Reports are then written whole (`written_whole`).
"""

from __future__ import annotations

import fcntl
import glob
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from .flocks import reap_unheld

ABANDONED_AFTER_S = 60.0
"""How old an unlocked temporary file of `written_whole` must be to be taken as abandoned."""


def nearest_existing_parent(path: Path) -> Path:
    """The deepest ancestor of `path` that exists (the directories below it would be made)."""
    return next(d for d in path.absolute().parents if d.exists())


def output_file_problem(
    path: Path, *, make_parents: bool = False, kind: str = "a file"
) -> str | None:
    """What stops a file being written at `path` (None: nothing).

    `make_parents`: the missing directories will be made, so the deepest existing one must be a
    writable directory; otherwise the parent must be one. `kind` says what to name instead of a
    directory ("a profile file (YAML or .json)").
    """
    try:  # is_dir() raises for a name too long for the file system
        if path.is_dir():
            return f"is a directory; name {kind}"
    except OSError as exc:
        return f"cannot write: {exc.strerror or exc}"
    folder = nearest_existing_parent(path) if make_parents else path.parent
    if not folder.exists():
        return f"there is no directory {folder}"
    if not folder.is_dir():
        return f"{folder} is a file, not a directory"
    try:
        if len(os.fsencode(path.name)) > os.pathconf(folder, "PC_NAME_MAX"):
            return "cannot write: File name too long"
        if not path.exists():  # the file is made (and removed) where it would go
            tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        return f"cannot write in {folder}: {exc.strerror or exc}"
    return None


def same_file(a: Path, b: Path) -> bool:
    """`a` and `b` name one file, by path (through links and `..`) or, both existing, by inode."""
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and a.samefile(b))
    except OSError:
        return False


def input_overwritten(out: Path, inputs: Iterable[Path]) -> Path | None:
    """The input that writing `out` would replace, or None: `describe P --plot P` replaced the
    profile with its PNG, `fit T --out T` the trace with its profile, exit 0."""
    return next((p for p in inputs if same_file(out, p)), None)


def output_dir_problem(path: Path) -> str | None:
    """What stops files being written in the directory `path`, made if missing (None: nothing)."""
    try:
        if path.exists() and not path.is_dir():
            return "is a file, not a directory"
        folder = path if path.exists() else nearest_existing_parent(path)
    except OSError as exc:
        return f"cannot make the directory: {exc.strerror or exc}"
    if not folder.is_dir():
        return f"{folder} is a file, not a directory"
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        return f"cannot write in {folder}: {exc.strerror or exc}"
    return None


@contextmanager
def written_whole(path: Path) -> Iterator[IO[str]]:
    """A text file written beside `path` and renamed onto it once whole: a write cut short (a full
    disk, a file-size limit) left the report that was there cut short, no longer parsing. A
    failed write's error names `path` (it named no file: "cannot write None")."""
    real = path.resolve()  # through a symlink, as writing in place did
    # a write killed outright (SIGKILL) left its hidden temporary file beside `path` for good,
    # one per kill: those nobody holds are removed (a live write holds its own locked)
    reap_unheld(
        real.parent.glob(f".{glob.escape(real.name)}.*.tmp"),
        lambda tmp: tmp.unlink(missing_ok=True),
        older_than_s=ABANDONED_AFTER_S,
    )
    fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".tmp")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # ours while we write: another writer's reap skips it
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o644)  # as a file written in place: mkstemp's is owner-only
            yield f
        os.replace(tmp, real)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        exc.filename = exc.filename if exc.filename and exc.filename != tmp else str(path)
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_whole(path: Path, text: str) -> None:
    """`path.write_text(text)`, whole or not at all (`written_whole`)."""
    with written_whole(path) as f:
        f.write(text)
