"""Which kind of PolyTrace file a path holds, which command reads that kind, and trace arguments
expanded (directories, names in the trace cache) for the commands that take them.

A reader handed the wrong kind of file (packed lengths to `rollout run --trace`, a multi-turn
trace to `--synthetic`) says what the file looks like and which option reads it, instead of
reporting the first missing field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from .cache import resolve_traces
from .calllog import MARKER as CALL_LOG_MARKER
from .errors import CaptureNotTrace, TraceFormatError
from .jsonl import numbered_lines, open_trace, read_jsonl, sorted_by_step

M = TypeVar("M", bound=BaseModel)

# Each kind: what it is, and which command reads it.
KINDS: dict[str, tuple[str, str]] = {
    "multiturn": (
        "a multi-turn trace",
        "`toolenv rollout run --trace` replays it, `toolenv emulators fit` reads its tool latencies",
    ),
    "call_log": (
        "a tool-call log",
        "`toolenv emulators fit` and `toolenv emulators describe --data` read it",
    ),
    "reward_timings": ("reward timings", "`toolenv emulators fit --tool reward` reads it"),
    "fitted_parameters": (
        "fitted intern_s1 parameters",
        "`toolenv rollout run --synthetic` reads it",
    ),
    "packed_lengths": (
        "single-turn packed lengths (no tool calls)",
        "no command replays it (`toolenv_core.polytrace.read_packed_lengths` reads it)",
    ),
    "dapo_filter": (
        "DAPO filter indices",
        "no command replays it (`toolenv_core.polytrace.read_dapo_filter` reads it)",
    ),
}
FORMATS = tuple(KINDS)


CAPTURE = "capture"  # what `files_of_kind` and `holdings` call a gateway trace capture they find


def describe(kind: str) -> str:
    """`<what it is>: <who reads it>` for a kind name."""
    if kind == CAPTURE:  # a folder of captures said "no PolyTrace kind this project reads"
        return (
            "a gateway trace capture: `toolenv gateway trace-to-multiturn CAPTURE OUT.jsonl` "
            "turns it into a multi-turn trace"
        )
    if kind not in KINDS:
        return "no PolyTrace kind this project reads"
    what, reader = KINDS[kind]
    return f"{what}: {reader}"


CAPTURE_KEYS = frozenset({"tool_name", "latency_s", "trajectory_id"})
"""A gateway trace capture's line (one `records.ToolCallRecord` a line), not a PolyTrace kind."""


def kind_of_record(raw: object) -> str | None:
    """The PolyTrace kind one parsed record belongs to, by its keys; None for none."""
    if not isinstance(raw, dict):
        return None
    if "turns" in raw:
        return "multiturn"
    if "reward_time_s" in raw:
        return "reward_timings"
    if "kept_prompt_indices" in raw:
        return "dapo_filter"
    if "output" in raw and "input" in raw:
        return "packed_lengths"
    if "math_task" in raw or "tool_calling_task" in raw:
        return "fitted_parameters"
    return None


class JsonDocument(TraceFormatError):
    """An indented JSON document of no PolyTrace kind (a rollout's report.json, a study.json):
    said as such, where a JSONL reader would call its first line, `{`, not valid JSON."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(
            path, 1, "", "a JSON document, not a PolyTrace file this project reads "
            f"(one of: {', '.join(FORMATS)})",
        )  # fmt: skip


FITTED_KEYS = ("math_task", "tool_calling_task")
"""The fitted parameters' task keys (`kind_of_record`), found by line in an indented document."""


def detect_format(path: str | Path) -> str:
    """Look at the first record of the file and name the PolyTrace kind it holds."""
    p = Path(path)
    empty = True
    document = False  # an indented JSON document: its keys come one a line
    with open_trace(p) as handle:
        for lineno, line in numbered_lines(handle, p):
            text = line.strip()
            empty = empty and not text
            if CALL_LOG_MARKER in text and not document:
                return "call_log"
            if lineno > 1000:
                break
            if not text:
                continue
            if document:  # any indented JSON began so (a rollout's report.json, a study.json)
                if text.startswith(tuple(f'"{key}":' for key in FITTED_KEYS)):
                    return "fitted_parameters"
                continue
            if text == "{":
                document = True
                continue
            if not text.startswith("{"):
                continue  # other log output before the first call record
            try:
                record = json.loads(text)
            except (ValueError, RecursionError):  # not JSON, an overlong integer, deep nesting
                break
            kind = kind_of_record(record)
            if kind is not None:
                return kind
            if isinstance(record, dict) and CAPTURE_KEYS <= record.keys():
                raise CaptureNotTrace(p, lineno)
            break
    if empty:
        raise TraceFormatError(p, 0, "", "the file is empty")
    if document:
        raise JsonDocument(p)
    raise TraceFormatError(
        p, 1, "", f"not a PolyTrace file this project reads (one of: {', '.join(FORMATS)})"
    )


def kind_error(path: str | Path, expected: str) -> TraceFormatError | None:
    """When the file is of another known kind than `expected`: an error saying which and who
    reads it (a gateway trace capture: how to convert it). None when it is of the expected kind
    or of no kind we know (the caller's own error then says what is wrong)."""
    try:
        found = detect_format(path)
    except (CaptureNotTrace, JsonDocument) as exc:  # a capture: say how to make a trace of it
        return exc
    except TraceFormatError:
        return None
    if found == expected:
        return None
    return TraceFormatError(
        path,
        1,
        "",
        f"this is not {KINDS[expected][0]}: it looks like {describe(found)}",
    )


def kind_of_file(path: Path) -> str:
    """`detect_format`, or `CAPTURE`, or "unknown": what a file found in a folder holds."""
    try:
        return detect_format(path)
    except CaptureNotTrace:
        return CAPTURE
    except TraceFormatError:
        return "unknown"


def read_kind(path: str | Path, model: type[M], kind: str, none_read: str) -> Iterator[M]:
    """`read_jsonl`, but a file whose first record fails because it is another kind says so, and
    one that holds no record (empty, or blank lines) raises `TraceFormatError` naming it with
    `none_read` once read to its end (beside other traces it was read as nothing)."""
    first = True
    try:
        for record in read_jsonl(path, model):
            first = False
            yield record
    except TraceFormatError as exc:
        if first and exc.line > 0:
            raise kind_error(path, kind) or exc from exc
        raise
    if first:
        raise TraceFormatError(path, 0, "", none_read)


def expand_paths(paths: Iterable[str | Path]) -> list[Path]:
    """Files as given (or found in the trace cache); a directory stands for its `*.jsonl` and
    `*.log` files."""
    out: list[Path] = []
    for p in resolve_traces(paths):
        if p.is_dir():
            out.extend(sorted([*p.glob("*.jsonl"), *p.glob("*.log")]))
        else:
            out.append(p)
    return out


def files_of_kind(paths: Iterable[str | Path], kind: str) -> list[Path]:
    """Trace arguments expanded for a reader of one kind, in step order: a file as given (its
    reader checks it), a directory for its files of that kind. A directory holding none says
    what it holds instead."""
    out: list[Path] = []
    for p in resolve_traces(paths):
        if not p.is_dir():
            out.append(p)
            continue
        found: dict[str, list[str]] = {}
        for f in sorted([*p.glob("*.jsonl"), *p.glob("*.json"), *p.glob("*.log")]):
            found.setdefault(kind_of_file(f), []).append(f.name)
        if not found.get(kind):
            held = "; ".join(
                f"{len(names)} file(s) like {names[0]}: {describe(k)}" for k, names in found.items()
            )
            raise TraceFormatError(
                p,
                0,
                "",
                f"holds no {KINDS[kind][0].removeprefix('a ')}"
                + (f"; it holds {held}" if held else ""),
            )
        out.extend(sorted_by_step([p / name for name in found[kind]]))
    return out


def repeat_notes(files: Iterable[Path], option: str, effect: str) -> list[str]:
    """A note for each file named more than once (a directory and a file in it, a path and its
    name in the trace cache, a link), as first named: every reader reads a file as often as it
    is given (`--trace search_r1 --trace search_r1/multiturn_workload_step_0.jsonl` replayed
    step 0 twice, silently). A note, not an error: a file given twice may be meant. `effect`:
    what repeating it does, e.g. "its calls are fitted"."""
    first: dict[Path, Path] = {}
    counts: dict[Path, int] = {}
    for f in files:
        real = f.resolve()
        first.setdefault(real, f)
        counts[real] = counts.get(real, 0) + 1
    notes = []
    for real, n in counts.items():
        if n > 1:
            times = "twice" if n == 2 else f"{n} times"
            notes.append(f"note: {first[real]} is given {times} ({option}): {effect} {times}")
    return notes


def holdings(files: Iterable[Path]) -> str:
    """What a set of trace files holds, kind by kind, with who reads each kind."""
    found: dict[str, int] = {}
    for f in files:
        kind = kind_of_file(f)
        found[kind] = found.get(kind, 0) + 1
    return "; ".join(f"{n} file(s) of {describe(k)}" for k, n in found.items())
