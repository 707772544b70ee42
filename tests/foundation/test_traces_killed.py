"""`toolenv traces fetch` killed where no clean-up runs (SIGKILL): the next fetch of the file
removes the temporary file it left, and never one a live fetch is writing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_traces import REPO_ROOT, STALLING_SERVER, leftovers
from testkit import ServerProcess, free_port

NAME = "intern_s1"


def fetch(cache: Path, source: str, **popen: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "toolenv", "traces", "fetch", NAME, "--from", source],
        cwd=REPO_ROOT,
        env={**os.environ, "TOOLENV_TRACES_CACHE_DIR": str(cache)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **popen,
    )


def fetched(cache: Path, source: str) -> str:
    done = fetch(cache, source)
    out, err = done.communicate(timeout=60)
    assert done.returncode == 0, err
    return out.decode()


def test_a_killed_fetch_leaves_nothing_past_the_next_fetch(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """Before: the killed fetch's hidden `.part` file stayed for ever, holding its space."""
    port = free_port()
    argv = [sys.executable, "-c", STALLING_SERVER, str(port), str(polytrace_dir)]
    server = ServerProcess(argv, f"http://127.0.0.1:{port}").start("/", timeout=30)
    cache = tmp_path / "cache"
    stalled = fetch(cache, server.url)
    try:
        deadline = time.monotonic() + 60
        while not leftovers(cache) and time.monotonic() < deadline and stalled.poll() is None:
            time.sleep(0.05)
        (part,) = leftovers(cache)
        # a fetch beside the live one caches the file, and leaves the live one's file alone
        fetched(cache, str(polytrace_dir))
        assert part.exists() and stalled.poll() is None
        stalled.send_signal(signal.SIGKILL)
        stalled.communicate(timeout=30)
    finally:
        stalled.kill()
        server.stop()
    assert leftovers(cache) == [part]  # SIGKILL: no clean-up ran
    assert "cached" in fetched(cache, str(polytrace_dir))  # the file was already there ...
    assert leftovers(cache) == []  # ... and the dead fetch's part file is gone
