"""`toolenv traces fetch` into a cache whose disk is full: each file fails naming the cache, not
the source, and no `.part` file stays behind to hold the space that was lacking."""

from __future__ import annotations

import errno
import io
import os
from pathlib import Path

import pytest

from toolenv_core.polytrace.fetch import Fetcher
from toolenv_core.polytrace.manifest import load_manifest

# A small file (written at once by the buffered flush) and a large one (written chunk by chunk).
NAMES = ["rllm_deepcoder/reward_timings_step_0.jsonl", "search_r1/multiturn_workload_step_0.jsonl"]


class _FullDisk(io.FileIO):
    """A file on a full disk: every write to it fails as the kernel's ENOSPC does."""

    def write(self, _data: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sink's temporary file lands on a full disk (as on a filled tmpfs, without a mount)."""
    monkeypatch.setattr(os, "fdopen", lambda fd, _mode: io.BufferedWriter(_FullDisk(fd, "wb")))


@pytest.mark.usefixtures("full_disk")
@pytest.mark.parametrize("name", NAMES)
def test_a_full_cache_fails_its_own_write_and_leaves_no_part_file(
    name: str, polytrace_dir: Path, tmp_path: Path
) -> None:
    manifest = load_manifest()
    [entry] = manifest.select([name])
    cache = tmp_path / "cache"
    (cache / name).parent.mkdir(parents=True)
    fetcher = Fetcher(manifest, cache, polytrace_dir)
    try:
        result = fetcher.fetch(entry)
    finally:
        fetcher.close()
    assert result.status == "failed"
    # The small file's close() failed too and its `.part` file stayed; the large one's error
    # said `cannot read` the source file in the mirror.
    assert result.error.startswith(f"{name}: cannot write {cache / name}: "), result.error
    assert "No space left on device" in result.error
    assert [p for p in cache.rglob("*") if p.is_file()] == []
