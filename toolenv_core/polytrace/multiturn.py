"""Streaming reader and writer for the PolyTrace multi-turn JSONL format.

Reads one line at a time (a 1 GB trace never sits in memory whole) and validates each record;
a malformed record raises `TraceFormatError` naming the file, the line and the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from .kinds import read_kind
from .records import TrajectoryRecord


def read_multiturn(path: str | Path) -> Iterator[TrajectoryRecord]:
    """Yield each trajectory of a multi-turn JSONL file, in file order; one that holds none raises
    `TraceFormatError` naming it once read to its end (`read_kind`)."""
    return read_kind(path, TrajectoryRecord, "multiturn", "holds no trajectories")


def read_multiturn_many(paths: Iterable[str | Path]) -> Iterator[TrajectoryRecord]:
    for path in paths:
        yield from read_multiturn(path)


def write_multiturn(records: Iterable[TrajectoryRecord], out: IO[str]) -> int:
    """Append records as JSONL (same field names as the published traces); returns the count."""
    n = 0
    for record in records:
        out.write(record.model_dump_json(by_alias=True, exclude_none=True) + "\n")
        n += 1
    return n
