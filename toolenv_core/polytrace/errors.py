"""The one error every PolyTrace reader raises: it names the file, the line and the field."""

from __future__ import annotations

from pathlib import Path


class TraceFormatError(ValueError):
    def __init__(self, path: str | Path, line: int, field: str, problem: str) -> None:
        self.path = str(path)
        self.line = line
        self.field = field
        self.problem = problem
        where = f"{self.path}:{line}" if line > 0 else self.path
        super().__init__(f"{where}: field {field!r}: {problem}" if field else f"{where}: {problem}")


class CaptureNotTrace(TraceFormatError):
    """A gateway trace capture (one tool call a line) given where a PolyTrace file is read."""

    HINT = (
        "a gateway trace capture (one tool call a line), not a PolyTrace file: turn it into one "
        "with `toolenv gateway trace-to-multiturn CAPTURE OUT.jsonl` and give OUT.jsonl"
    )

    def __init__(self, path: str | Path, line: int) -> None:
        super().__init__(path, line, "", self.HINT)
