"""Streaming reader and writer for the PolyTrace multi-turn JSONL format.

Reads one line at a time (a 1 GB trace never sits in memory whole) and validates each record;
a malformed record raises `TraceFormatError` naming the file, the line and the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from pydantic import ValidationError

from .errors import TraceFormatError
from .records import TrajectoryRecord


def _field_of(exc: ValidationError) -> tuple[str, str]:
    first = exc.errors()[0]
    return ".".join(str(p) for p in first["loc"]), first["msg"]


def read_multiturn(path: str | Path) -> Iterator[TrajectoryRecord]:
    """Yield each trajectory of a multi-turn JSONL file, in file order."""
    p = Path(path)
    try:
        handle = p.open("r", encoding="utf-8")
    except OSError as exc:
        raise TraceFormatError(p, 0, "", f"cannot open: {exc.strerror or exc}") from exc
    with handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(
                    p, lineno, "", f"not valid JSON ({exc.msg} at column {exc.colno})"
                ) from exc
            if not isinstance(raw, dict):
                raise TraceFormatError(
                    p, lineno, "", f"expected a JSON object, got {type(raw).__name__}"
                )
            try:
                yield TrajectoryRecord.model_validate(raw)
            except ValidationError as exc:
                field, msg = _field_of(exc)
                raise TraceFormatError(p, lineno, field, msg) from exc


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
