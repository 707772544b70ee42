"""What the Docker backend's tests share: the sandbox image, the containers of a pool, a run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from anyio.from_thread import BlockingPortal

from sandboxd.docker_backend import DockerBackend
from sandboxd.models import RunResult, RunSpec
from toolenv_core.deadline import Deadline

REPO = Path(__file__).resolve().parents[2]
IMAGE = "toolenv/sandbox:0.1.0"


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
