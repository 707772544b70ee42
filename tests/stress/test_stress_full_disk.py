"""`toolenv stress --out` on a disk that fills while the report is written (a file-size limit, as
a full disk fails the same write): the report that was there stays whole, and the error names it."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
from pathlib import Path

LIMIT_BYTES = 500  # a run's report is longer than this


def _file_size_limit() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT_BYTES, LIMIT_BYTES))


def test_a_report_cut_short_leaves_the_earlier_one_whole(fast_server: str, tmp_path: Path) -> None:
    """The earlier report was cut at the limit (no longer JSON) and the error said `cannot write
    None: File too large`."""
    out = tmp_path / "r.json"
    earlier = json.dumps({"earlier": "x" * 3 * LIMIT_BYTES}) + "\n"
    out.write_text(earlier)
    cmd = [
        sys.executable, "-m", "stress", "--url", fast_server + "/x", "--rate", "50",
        "--duration", "0.2s", "--quiet", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        cmd, preexec_fn=_file_size_limit, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert f"error: cannot write {out}: File too large" in done.stderr
    assert out.read_text() == earlier
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left
