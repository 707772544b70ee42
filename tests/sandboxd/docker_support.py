"""What the Docker backend's tests share: the sandbox image, the containers of a pool, a run, and
the probe that a container keeps nothing of a hostile run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from anyio.from_thread import BlockingPortal

from sandboxd.docker_backend import DockerBackend
from sandboxd.languages import CHILD_ENV
from sandboxd.models import ExecStatus, Limits, RunResult, RunSpec
from toolenv_core.deadline import Deadline

REPO = Path(__file__).resolve().parents[2]
IMAGE = "toolenv/sandbox:0.1.0"

PROBE = r"""
import json, os
me = os.getpid()
procs = []
for p in os.listdir('/proc'):
    if p.isdigit() and int(p) != me:
        try:
            st = open(f'/proc/{p}/status').read()
        except OSError:
            continue
        fields = dict(line.split(':', 1) for line in st.splitlines() if ':' in line)
        procs.append([int(p), int(fields['Uid'].split()[0]), fields['Name'].strip()])
files = {d: sorted(os.listdir(d)) for d in ('/sandbox', '/tmp', '/dev/shm', '/dev/mqueue')}
ipc = {k: open('/proc/sysvipc/' + k).read().splitlines()[1:] for k in ('shm', 'sem', 'msg')}
print(json.dumps({'procs': procs, 'files': files, 'env': dict(os.environ), 'ipc': ipc}))
"""


def build_sandbox_image(base_image: str) -> str:
    """The sandbox image on `base_image`, built by the project's script (idempotent)."""
    env = {**os.environ, "TOOLENV_BASE_IMAGE": base_image, "TOOLENV_SANDBOX_DOCKER_IMAGE": IMAGE}
    subprocess.run([str(REPO / "scripts/build_sandbox_image.sh")], env=env, check=True, timeout=600)
    return IMAGE


def labelled(label: str) -> list[str]:
    """IDs of the containers, running or not, that carry `label` (`key=value`)."""
    out = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label={label}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


def run(
    portal: BlockingPortal, backend: DockerBackend, spec: RunSpec, deadline_s: float = 30.0
) -> RunResult:
    return portal.call(backend.run, spec, Deadline.after(deadline_s))


def assert_clean_after(
    portal: BlockingPortal, backend: DockerBackend, hostile: RunResult, same: bool = True
) -> None:
    """The backend answers, and the next run (same container) sees nothing of the hostile one."""
    spec = RunSpec(language="python", code=PROBE, run_limits=Limits(wall_time_s=3.0))
    probe = run(portal, backend, spec)
    assert probe.run is not None and probe.run.status == ExecStatus.FINISHED, probe
    if same:
        assert probe.sandbox_id == hostile.sandbox_id, "expected the same container to be reused"
    else:
        assert probe.sandbox_id != hostile.sandbox_id, "expected the container to be replaced"
    seen = json.loads(probe.run.stdout)
    assert seen["procs"] == [[1, 0, "python3"]], f"processes left: {seen['procs']}"
    assert seen["files"] == {"/sandbox": ["main.py"], "/tmp": [], "/dev/shm": [], "/dev/mqueue": []}
    assert seen["ipc"] == {"shm": [], "sem": [], "msg": []}
    assert seen["env"] == CHILD_ENV
