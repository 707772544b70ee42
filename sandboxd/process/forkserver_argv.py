"""The zygote's own bubblewrap sandbox: the argv the fork server starts it with."""

from __future__ import annotations

import os
from pathlib import Path

from ..languages import CHILD_ENV
from .bwrap import SANDBOX_UID, interpreter_binds, system_binds

ZYGOTE_SCRIPT = Path(__file__).with_name("zygote_main.py")
# imported by the zygote script from its own dir (the program's process forgets them)
ZYGOTE_MODULES = [Path(__file__).with_name(f"zygote_{m}.py") for m in ("cases", "program")]
CAP_CHOWN, CAP_SYS_ADMIN = 0, 21


def needs_user_namespace() -> bool:
    """Whether the zygote needs a user namespace of its own to hold the capabilities it builds
    runs with: yes unless the service is root with CAP_SYS_ADMIN and CAP_CHOWN (a container
    with least privilege has neither)."""
    if os.geteuid() != 0:
        return True
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            eff = int(line.split()[1], 16)
            return not (eff & (1 << CAP_CHOWN) and eff & (1 << CAP_SYS_ADMIN))
    return True


def _dev_without_devpts() -> list[str]:
    """What `--dev /dev` lays out, minus the devpts mount (each runner mounts its own). With
    `--dev`, bwrap mounts devpts as uid 0 of a first user namespace and then moves into a second
    one: runners' mount namespaces would then lock the zygote's /proc under its read-only
    overmounts, and the kernel refuses a fresh /proc where none is fully visible."""
    argv = ["--tmpfs", "/dev"]
    for node in ("full", "null", "random", "tty", "urandom", "zero"):
        argv += ["--dev-bind", f"/dev/{node}", f"/dev/{node}"]
    links = {"core": "/proc/kcore", "fd": "/proc/self/fd", "ptmx": "pts/ptmx"}
    links |= {name: f"/proc/self/fd/{i}" for i, name in enumerate(("stdin", "stdout", "stderr"))}
    for name, target in links.items():
        argv += ["--symlink", target, f"/dev/{name}"]
    return [*argv, "--dir", "/dev/pts", "--dir", "/dev/shm"]


def zygote_argv(bwrap: str, root: Path, python: str, userns: bool = False) -> list[str]:
    """The zygote's own sandbox: the programs' file system view, kept capabilities (it builds
    each run's namespaces), no network, and only the run dirs besides.

    `userns`: the zygote runs as uid/gid 65534 in a user namespace of its own that maps them to
    the service's; every capability it keeps is that namespace's, and its programs' files, the
    service's, are theirs without a chown (as in a bwrap sandbox made without privileges)."""
    user = ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    argv = [
        bwrap,
        *(user if userns else []),
        "--unshare-ipc", "--unshare-net", "--unshare-uts",
        "--die-with-parent", "--new-session",
        "--cap-add", "ALL",
        "--hostname", "sandbox",
        *system_binds(),
        "--proc", "/proc",
        *(_dev_without_devpts() if userns else ["--dev", "/dev"]),
        "--tmpfs", "/tmp",
        "--dir", "/newroot",
        "--bind", str(root), "/runs",
        "--ro-bind", str(ZYGOTE_SCRIPT), "/sandbox/main.py",
        *[a for m in ZYGOTE_MODULES for a in ("--ro-bind", str(m), f"/sandbox/{m.name}")],
        "--chdir", "/sandbox",
    ]  # fmt: skip
    argv += ["--clearenv"]
    for key, value in CHILD_ENV.items():
        argv += ["--setenv", key, value]
    return [*argv, *interpreter_binds(python), "--", python, "main.py"]
