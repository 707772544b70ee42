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
