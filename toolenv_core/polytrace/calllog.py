"""The one-line-per-call log format: `Step{n}, Request ID: {id}, Tool: {name}, Latency: {x} seconds`.

Lines may carry a prefix (a timestamp, a logger name): the record is found anywhere in the line.
Lines without `Request ID:` are other log output and are skipped; a line that has it but does not
parse raises `TraceFormatError` naming the field that is wrong.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from pydantic import BaseModel, Field

from .errors import TraceFormatError
from .jsonl import numbered_lines, open_trace

MARKER = "Request ID:"
_LINE = re.compile(
    r"Step\s*(?P<step>\S*?),\s*Request ID:\s*(?P<request_id>[^,]*?),\s*Tool:\s*(?P<tool>[^,]*?),"
    r"\s*Latency:\s*(?P<latency>\S*)\s*seconds"
)
_FIELDS = ("step", "request_id", "tool", "latency")


class CallLogRecord(BaseModel):
    step: int = Field(ge=0)
    request_id: str
    tool: str
    latency_s: float = Field(ge=0)

    def to_line(self) -> str:
        return f"Step{self.step}, Request ID: {self.request_id}, Tool: {self.tool}, Latency: {self.latency_s!r} seconds"


def _missing_field(line: str) -> str:
    """Which part of a line that mentions `Request ID:` is absent or out of order."""
    for label, field in (
        ("Step", "step"),
        ("Request ID:", "request_id"),
        ("Tool:", "tool"),
        ("Latency:", "latency"),
    ):
        if label not in line:
            return field
    return "latency" if "seconds" not in line else "step"


def parse_call_log_line(line: str, path: str | Path = "<line>", lineno: int = 0) -> CallLogRecord:
    m = _LINE.search(line)
    if m is None:
        field = _missing_field(line)
        raise TraceFormatError(
            path,
            lineno,
            field,
            "line does not match 'Step{n}, Request ID: {id}, Tool: {name}, Latency: {x} seconds'",
        )
    step, request_id, tool, latency = (m.group(f).strip() for f in _FIELDS)
    if not step.isdigit():
        raise TraceFormatError(
            path, lineno, "step", f"expected a non-negative integer, got {step!r}"
        )
    if not request_id:
        raise TraceFormatError(path, lineno, "request_id", "is empty")
    if not tool:
        raise TraceFormatError(path, lineno, "tool", "is empty")
    try:
        seconds = float(latency)
    except ValueError as exc:
        raise TraceFormatError(
            path, lineno, "latency", f"expected a number of seconds, got {latency!r}"
        ) from exc
    if not math.isfinite(seconds) or seconds < 0:
        raise TraceFormatError(
            path, lineno, "latency", f"must be finite and non-negative, got {latency!r}"
        )
    return CallLogRecord(step=int(step), request_id=request_id, tool=tool, latency_s=seconds)


def read_call_log(path: str | Path) -> Iterator[CallLogRecord]:
    """Stream every call record of a log file, skipping unrelated log lines."""
    p = Path(path)
    with open_trace(p) as handle:
        for lineno, line in numbered_lines(handle, p):
            if MARKER in line:
                yield parse_call_log_line(line, p, lineno)


def write_call_log(records: Iterable[CallLogRecord], out: IO[str]) -> int:
    n = 0
    for record in records:
        out.write(record.to_line() + "\n")
        n += 1
    return n
