"""A service whose app fails to start says why in one line (`toolenv_core.serving`)."""

from __future__ import annotations

import os
import subprocess
import sys

NO_ENGINE = {"DOCKER_HOST": "unix:///nonexistent/docker.sock"}  # no engine answers there


def run_sandboxd_on_docker(*extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "toolenv", "sandboxd", "serve", "--backend", "docker",
         "--host", "127.0.0.1", "--port", "0", *extra],
        env={**os.environ, **NO_ENGINE},
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip


def test_a_failed_start_up_is_one_line_and_exit_3() -> None:
    """It was Starlette's traceback, 40 lines of the server's own files, with the reason last."""
    out = run_sandboxd_on_docker()
    assert out.returncode == 3, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 2, out.stderr
    assert lines[0].startswith(
        "ERROR:    SandboxUnavailable: the docker backend needs a running Docker engine ("
    ), out.stderr
    assert lines[0].endswith("; start dockerd, or use --backend process"), out.stderr
    assert lines[1] == "ERROR:    Application startup failed. Exiting."


def test_the_traceback_of_a_failed_start_up_is_kept_at_debug_level() -> None:
    out = run_sandboxd_on_docker("--log-level", "debug")
    assert out.returncode == 3, out.stderr
    assert "Traceback (most recent call last)" in out.stderr, out.stderr
    assert "SandboxUnavailable: the docker backend needs a running Docker engine" in out.stderr
