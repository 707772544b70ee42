"""Run dirs of a process-backend instance that was killed: who removes them, and when."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sandboxd.models import RunSpec
from sandboxd.process import ProcessBackend
from sandboxd.process.cgroups import PREFIX
from sandboxd.settings import SandboxSettings
from toolenv_core.deadline import Deadline


def settings(root: Path) -> SandboxSettings:
    return SandboxSettings(max_concurrency=2, workdir_root=str(root), fork_server=False)


async def test_run_dirs_left_by_a_killed_instance_with_this_pid_are_removed(
    bwrap_path: str, tmp_path: Path
) -> None:
    """A container restarted after a kill -9 runs its service with its predecessor's pid: the
    run dirs that one left (and what its programs wrote) were taken over and kept forever."""
    left = tmp_path / f"{PREFIX}{os.getpid()}" / "run-killed"
    left.mkdir(parents=True)
    (left / "big").write_bytes(b"x" * 4096)
    backend = ProcessBackend(settings(tmp_path))
    await backend.start()
    try:
        assert not left.exists()
        r = await backend.run(RunSpec(language="python", code="print(1)"), Deadline.after(20))
        assert r.run is not None and r.run.stdout == "1\n"
    finally:
        await backend.close()


async def test_an_instance_sharing_the_root_and_the_pid_keeps_its_own_dir(
    bwrap_path: str, tmp_path: Path
) -> None:
    """Two instances with one pid (replicas in their own PID namespaces) over one workdir root
    shared one dir, and the first to stop removed the other's dir under its running programs."""
    first = ProcessBackend(settings(tmp_path))
    await first.start()
    try:
        second = ProcessBackend(settings(tmp_path))
        await second.start()
        assert second.root != first.root
        await second.close()
        assert first.root is not None and first.root.is_dir()
        r = await first.run(RunSpec(language="bash", code="echo ok"), Deadline.after(20))
        assert r.run is not None and r.run.stdout == "ok\n"
    finally:
        await first.close()
    assert not any(tmp_path.iterdir())


async def test_a_deeply_nested_dir_left_by_a_killed_instance_does_not_stop_the_start(
    bwrap_path: str, tmp_path: Path
) -> None:
    """A program of the killed instance had nested 3000 dirs (`mkdir d; cd d` in a loop): the
    next start's clean-up raised RecursionError, and sandboxd did not start at all."""
    left = tmp_path / f"{PREFIX}{os.getpid()}" / "run-killed"
    left.mkdir(parents=True)
    nest = "import os\nfor _ in range(3000):\n    os.mkdir('d'); os.chdir('d')"  # past PATH_MAX
    subprocess.run([sys.executable, "-c", nest], cwd=left, check=True)
    backend = ProcessBackend(settings(tmp_path))
    await backend.start()
    try:
        assert not left.exists()
        r = await backend.run(RunSpec(language="bash", code="echo ok"), Deadline.after(20))
        assert r.run is not None and r.run.stdout == "ok\n"
    finally:
        await backend.close()
