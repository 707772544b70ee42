"""The run's working dir on the host: safe names, where dirs live, inputs in, requested files out."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..languages import Language
from ..models import RunSpec
from .cgroups import claim_instance_dir, reap_dead_instances

_SOURCE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC


class InvalidPath(ValueError):
    """A file name in `files` / `fetch_files` that would leave the working dir."""


NAME_MAX = 255  # bytes in one file name (Linux)
PATH_MAX_BYTES = 1024  # a whole path: PATH_MAX (4096) less ample room for the host's run dir


def safe_relative_path(name: str) -> Path:
    """A workdir-relative path with no `..`, no absolute part, no NUL, that the file system can
    hold (a name too long was an ENAMETOOLONG showing the host's run dir, a lone surrogate a
    UnicodeEncodeError); else `InvalidPath`."""
    p = Path(name)
    # each refusal says what is wrong with the path ('' and '\n' were "must be relative ...
    # without '..'", which they are)
    if name.strip() in (".", ""):
        raise InvalidPath(f"file path {name!r} names no file: it is empty, blank or '.'")
    if "\0" in name:
        raise InvalidPath(f"file path {name!r} has a NUL byte: no file name can hold it")
    if p.is_absolute() or ".." in p.parts:
        raise InvalidPath(f"file path {name!r} must be relative to the working dir, without '..'")
    try:
        size = len(name.encode())
    except UnicodeEncodeError:  # a lone surrogate (JSON allows its escape): no file can have it
        raise InvalidPath(f"file path {name!r} has a lone surrogate: not valid Unicode") from None
    if size > PATH_MAX_BYTES or any(len(part.encode()) > NAME_MAX for part in p.parts):
        raise InvalidPath(
            f"file path {name[:64]!r}... is too long: at most {PATH_MAX_BYTES} bytes, "
            f"{NAME_MAX} per name"
        )
    return p


def default_workdir_root() -> Path:
    """/dev/shm (a tmpfs: what a program writes is charged to its memory cgroup), else tmp."""
    shm = Path("/dev/shm")
    # A container's /dev/shm is mounted noexec: compiled programs could not run from it.
    if shm.is_dir() and os.access(shm, os.W_OK) and not os.statvfs(shm).f_flag & os.ST_NOEXEC:
        return shm
    return Path(tempfile.gettempdir())


def remove_tree(path: Path) -> None:
    """`shutil.rmtree(path, ignore_errors=True)` that leaves nothing a program made behind:
    - a program can nest dirs without bound (a `mkdir d; cd d` loop), and rmtree recurses once
      per level: 3000 levels raised RecursionError out of the run (a `SandboxError` answer);
    - a service without CAP_DAC_OVERRIDE (compose's least privilege) cannot empty a dir the
      program made read-only (`chmod 500 d`): the run dir, and all it held in /dev/shm, stayed
      until the service stopped (and after). As the files' owner it may make them writable.
    Either way `chmod -R` and `rm -rf` (any depth) finish the job; they run only for such a tree."""
    with contextlib.suppress(RecursionError):
        shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):
        for argv in (["chmod", "-R", "u+rwx"], ["rm", "-rf", "--one-file-system"]):
            quiet = subprocess.DEVNULL
            subprocess.run([*argv, "--", str(path)], check=False, stdout=quiet, stderr=quiet)


def claim_workdir_root(parent: Path) -> tuple[Path, int]:
    """This instance's dir for run dirs under `parent` and the fd of its lock, after removing
    those of instances that are gone, as the cgroups are: a dead pid, or this one's (a restarted
    container's service has its predecessor's pid, and took over its dir with every run dir it
    left), and no live instance holding it (two sharing `parent` shared one dir, and the first
    to stop removed the other's runs)."""
    reap_dead_instances(parent, remove_tree)
    return claim_instance_dir(parent, mode=0o700)


def new_workdir(root: Path) -> Path:
    return Path(tempfile.mkdtemp(prefix="run-", dir=root))


def write_inputs(workdir: Path, spec: RunSpec, lang: Language, owner: int | None = None) -> None:
    """The request's files and the source file; raises InvalidPath or OSError.

    `owner`: the uid (and gid) the program runs as outside any user namespace (the fork
    server's runs): the dir and every file written are given to it, as bwrap's mapping does.
    """
    written = [workdir]
    for name, content in spec.files.items():
        target = workdir / safe_relative_path(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        written += [target, *target.relative_to(workdir).parents]
    # the source through its fd (os calls, no Path): it is written for every run
    fd = os.open(f"{workdir}/{lang.source_file}", _SOURCE_FLAGS, 0o666)
    try:
        view = memoryview(spec.code.encode())
        while view:
            view = view[os.write(fd, view) :]
        if owner is not None:
            os.fchown(fd, owner, owner)
    finally:
        os.close(fd)
    if owner is not None:
        for path in dict.fromkeys(written):
            os.chown(workdir / path, owner, owner)


def remove_lone_source(workdir: Path, source_file: str) -> bool:
    """Remove a run dir that holds only its source (most runs): False if more is left."""
    try:
        os.unlink(f"{workdir}/{source_file}")
        os.rmdir(workdir)
    except OSError:
        return False
    return True


def remove_workdir(workdir: Path, source_file: str) -> None:
    """Remove a run dir: the source and the dir when that is all it holds (most runs), else
    the whole tree."""
    if not remove_lone_source(workdir, source_file):
        remove_tree(workdir)


def fetch_files(workdir: Path, names: list[str], cap: int) -> dict[str, bytes]:
    """Read requested files, refusing symlinks and anything outside the working dir: at most
    `cap` bytes together, in the order asked, as the Docker agent counts them (a file larger
    than what is left is left out). The cap was per file: a run with a 4 GB memory limit wrote
    250 files of 16 MiB and had them all back, 5.4 GB of base64 in one answer."""
    out: dict[str, bytes] = {}
    if not names:
        return out
    left = cap
    real_root = os.path.realpath(workdir)
    for name in names:
        try:
            rel = safe_relative_path(name)
        except InvalidPath:
            continue
        path = workdir / rel
        if not os.path.realpath(path.parent).startswith(real_root):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if (st.st_mode & 0o170000) == 0o100000 and st.st_size <= left:
                out[name] = os.read(fd, st.st_size) if st.st_size else b""
                left -= len(out[name])
        finally:
            os.close(fd)
    return out


STDIN_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def stdin_file(data: bytes) -> int:
    """A sealed memfd holding `data`, positioned at 0: a stdin of any size that never blocks,
    that no one can change (not even through /proc/self/fd), and that touches no file system
    (an unlinked temp file in the runs dir cost a directory entry made and removed per run)."""
    fd = os.memfd_create("stdin", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, STDIN_SEALS)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd
