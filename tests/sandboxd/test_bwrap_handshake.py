"""A bwrap start cancelled mid-handshake leaves nothing behind, not even the child it cloned.

bwrap clones its child, reports the child's pid on the status fd and only then lets the child go
on (through an eventfd, which never reads end-of-file): the child sets up --die-with-parent
after that. bwrap killed in between left the child blocked for good, an orphan of init holding
its namespaces (1 to 2 in 20 starts and closes of a warm-spawn backend on the test machine). A
stand-in for bwrap that reports late makes the window wide.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from sandboxd.process.bwrap import spawn_blocked

# bwrap's part: a child that waits forever (as on its eventfd), reported 0.3 s later
STAND_IN = """import os, signal, sys, time
args = sys.argv[1:]
status_fd = int(args[args.index("--json-status-fd") + 1])
child = os.fork()
if child == 0:
    signal.pause()
with open(sys.argv[1], "w") as f:
    f.write(str(child))
time.sleep(0.3)
os.write(status_fd, b'{"child-pid": %d}\\n' % child)
signal.pause()
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


async def test_a_start_cancelled_before_the_report_kills_the_child_too(tmp_path: Path) -> None:
    stand_in, pid_file = tmp_path / "bwrap.py", tmp_path / "child.pid"
    stand_in.write_text(STAND_IN)
    start = asyncio.create_task(
        spawn_blocked([sys.executable, str(stand_in), str(pid_file)], tmp_path, ["true"], None)
    )
    for _ in range(200):  # until the child exists, before bwrap reports it
        if pid_file.exists() and pid_file.read_text():
            break
        await asyncio.sleep(0.01)
    child = int(pid_file.read_text())
    start.cancel()
    await asyncio.gather(start, return_exceptions=True)
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    alive = _alive(child)
    if alive:
        os.kill(child, 9)
    assert not alive, "the child bwrap cloned outlived the cancelled start"
