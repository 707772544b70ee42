"""`make run` (the README's first command) serves the embedded gateway and stops on Ctrl-C."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_make_run_serves_healthz_and_stops_cleanly(bwrap_path: str, port: int) -> None:
    if shutil.which("make") is None:
        pytest.skip("missing component: make (apt-get install make)")
    venv = os.environ.get("VIRTUAL_ENV", str(REPO_ROOT / ".venv"))
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "run", f"PORT={port}"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "VENV": venv},
    )
    try:
        deadline = time.monotonic() + 120
        body = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                body = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).json()
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert body == {"status": "ok"}, (
            proc.stdout.read().decode() if proc.poll() is not None else body
        )
    finally:
        os.killpg(
            proc.pid, signal.SIGINT
        )  # what Ctrl-C in a terminal sends to the foreground group
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    # Nothing left running in the group, and the port is free again.
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
    # It said how to get the `toolenv` command on PATH.
    out = proc.stdout.read().decode()
    assert f"'source {venv}/bin/activate' puts it on your PATH" in out, out
