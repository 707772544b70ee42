"""One streaming JSONL loop shared by every PolyTrace reader: parse, validate, name file/line/field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

from pydantic import BaseModel, ValidationError

from ..errors import first_problem
from .errors import TraceFormatError

M = TypeVar("M", bound=BaseModel)


def open_trace(path: str | Path) -> IO[str]:
    """The file as UTF-8 text; an editor's byte order mark at its start is read past (it was
    "not valid JSON (Unexpected UTF-8 BOM ...)")."""
    p = Path(path)
    try:
        return p.open("r", encoding="utf-8-sig")
    except OSError as exc:
        raise TraceFormatError(p, 0, "", f"cannot open: {exc.strerror or exc}") from exc


def not_text(path: str | Path, lineno: int, exc: UnicodeDecodeError) -> TraceFormatError:
    """A file that does not decode as UTF-8: name it, the line, and the likely cause."""
    p = Path(path)
    hint = "PolyTrace files are UTF-8 JSONL text"
    try:
        with p.open("rb") as f:
            if f.read(2) == b"\x1f\x8b":
                hint = "it is gzip-compressed: decompress it first (gunzip)"
    except OSError:
        pass
    byte = exc.object[exc.start] if exc.start < len(exc.object) else 0
    return TraceFormatError(
        p, lineno, "", f"not UTF-8 text (byte 0x{byte:02x} cannot be decoded): {hint}"
    )


def numbered_lines(handle: IO[str], path: str | Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of an open trace; a decode error names the file and the line."""
    lineno = 0
    try:
        for lineno, line in enumerate(handle, start=1):  # noqa: B007 (read in the handler)
            yield lineno, line
    except UnicodeDecodeError as exc:
        raise not_text(path, lineno + 1, exc) from exc


def not_json(exc: json.JSONDecodeError) -> str:
    """What a JSON error says, with its column: some of json's messages end in "at" already
    ("Unterminated string starting at"), which read "starting at at column 1577"."""
    return f"not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})"


def json_line(path: str | Path, lineno: int, line: str) -> Any:
    """One line's JSON; raises TraceFormatError naming the file and line for one that is not JSON,
    holds an integer past Python's 4300-digit conversion limit, or nests past its recursion limit
    (the last two were a traceback, not one line)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        problem = not_json(exc)
    except ValueError:  # json reads an integer of any length, up to the conversion limit
        problem = "JSON too large to read (an integer of more than 4300 digits)"
    except RecursionError:
        problem = "JSON too large to read (nested too deeply)"
    raise TraceFormatError(Path(path), lineno, "", problem)


def not_an_object(value: Any) -> str:
    """What a record that is not a JSON object is, in JSON's words (it said `got NoneType`)."""
    kinds = ((bool, "true or false"), (int | float, "a number"), (str, "a string"))
    held = next((name for kind, name in kinds if isinstance(value, kind)), None)
    if held is None:
        held = "null" if value is None else "an array"
    return f"expected a JSON object, got {held}"


def read_jsonl(path: str | Path, model: type[M]) -> Iterator[M]:
    """Yield each line of a JSONL file as `model`, one line in memory at a time."""
    p = Path(path)
    with open_trace(p) as handle:
        for lineno, line in numbered_lines(handle, p):
            if not line.strip():
                continue
            raw = json_line(p, lineno, line)
            if not isinstance(raw, dict):
                raise TraceFormatError(p, lineno, "", not_an_object(raw))
            try:
                yield model.model_validate(raw)
            except ValidationError as exc:
                field, msg = first_problem(exc)
                raise TraceFormatError(p, lineno, field, msg) from exc


def line_of_record(path: str | Path, index: int) -> int:
    """The line of a file's `index`-th record (from 0; blank lines hold none): for an error about
    a record found wrong after the file was read."""
    p = Path(path)
    seen = -1
    with open_trace(p) as handle:
        for lineno, line in numbered_lines(handle, p):
            seen += bool(line.strip())
            if seen == index:
                return lineno
    return 0


def step_of_filename(path: str | Path) -> int | None:
    """`..._step_12.jsonl` -> 12 (used to order files by step, not by name)."""
    stem = Path(path).stem
    tail = stem.rsplit("_step_", 1)
    if len(tail) == 2 and tail[1].isdigit():
        return int(tail[1])
    return None


def sorted_by_step(paths: list[str | Path]) -> list[Path]:
    """Files ordered by the step number in their name (step_2 before step_10)."""
    return sorted(
        (Path(p) for p in paths),
        key=lambda p: (step_of_filename(p) is None, step_of_filename(p) or 0, str(p)),
    )
