"""Trace capture: every call that carries `X-Trajectory-Id` becomes one PolyTrace tool-call line.

Each line is an `toolenv_core.polytrace.records.ToolCallRecord` (the multi-turn `tool_calls[]`
shape: tool_name, turn, latency_s, status, response_bytes, trajectory_id, step), so a workload
recorded through the gateway replays with the emulators: `to_multiturn` groups the calls of each
trajectory into one multi-turn `TrajectoryRecord` line, which `toolenv_core.polytrace` reads like a
published trace (`toolenv gateway trace-to-multiturn CAPTURE OUT`). Calls are queued in memory and
written by a worker thread in batches (at most every 50 ms): the event loop never waits on the
disk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import anyio
from pydantic import TypeAdapter, ValidationError

from toolenv_core.polytrace.errors import TraceFormatError
from toolenv_core.polytrace.jsonl import json_line, numbered_lines, open_trace
from toolenv_core.polytrace.records import ToolCallRecord, TrajectoryRecord, TurnRecord

log = logging.getLogger("toolenv.gateway")


class TraceWriter:
    """Queues each call's fields on the event loop (no model built there: a validated record costs
    several microseconds a call); a worker thread validates and serializes them a batch at a time
    as `ToolCallRecord`s, appends the lines and flushes."""

    def __init__(
        self, path: str | Path, max_pending: int = 100_000, flush_interval_s: float = 0.05
    ) -> None:
        self.path = Path(path)
        # Batches at most this often: each hand-over to the thread costs a wake-up (and the GIL
        # going back and forth), which per call would cost more than the record.
        self.flush_interval_s = flush_interval_s
        self._queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=max_pending)
        self._task: asyncio.Task[None] | None = None
        self._handle: BinaryIO | None = None  # the file written (the worker thread's)
        self.dropped = 0
        self.invalid = 0
        self.written = 0
        self.failed: str | None = None  # why the capture stopped writing, once a write failed

    async def start(self) -> None:
        """Opens the file here, not in the writer task: one that cannot be opened fails start-up
        rather than a task nobody awaits (a capture that records nothing, silently)."""
        self._handle = await anyio.to_thread.run_sync(lambda: open_capture(self.path))
        self._task = asyncio.create_task(self._run(), name="trace-writer")

    def record(self, fields: dict[str, Any]) -> None:
        """Queue one call's `ToolCallRecord` fields (never blocks; a full queue drops and counts
        rather than stall calls)."""
        try:
            self._queue.put_nowait(fields)
        except asyncio.QueueFull:
            self.dropped += 1

    async def _run(self) -> None:
        try:
            stop = False
            while not stop:
                batch = [await self._queue.get()]
                while not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                if None in batch:
                    stop = True
                calls = [fields for fields in batch if fields is not None]
                if calls and self.failed is None:
                    try:
                        await anyio.to_thread.run_sync(self._write, calls)
                    except OSError as exc:  # e.g. the disk is full: said now, not at shut-down
                        self._stop_writing(exc)
                if self.failed is not None:  # still drained: close() must not wait on a full queue
                    self.dropped += len(calls)
                if not stop:
                    await asyncio.sleep(self.flush_interval_s)
        finally:
            try:
                await anyio.to_thread.run_sync(self._handle.close)
            except OSError as exc:  # its buffer flushed once more: said once, not twice
                if self.failed is None:
                    self._stop_writing(exc)

    def _stop_writing(self, exc: OSError) -> None:
        """A write failed: the capture stops (a retried batch could land after half a line) and
        says so at once; what was not written, and every call from now on, counts as dropped.
        Before, the writer task died silently: nothing said until shut-down, and a full queue
        then held shut-down forever."""
        self.failed = exc.strerror or str(exc)
        log.error(
            "trace capture stopped: calls from now on are not recorded",
            extra={"trace_path": str(self.path), "error": self.failed},
        )

    def _write(self, calls: list[dict[str, Any]]) -> None:
        """In the worker thread: one batch validated at once, written as JSON lines."""
        try:
            records = _CALLS.validate_python(calls)
        except ValidationError:  # one bad call must not cost the batch: keep the good ones
            records = []
            for fields in calls:
                try:
                    records.append(ToolCallRecord.model_validate(fields))
                except ValidationError:
                    self.invalid += 1
        if records:
            # the model's own serializer, without `model_dump_json`'s wrapper: half the cost
            lines = [_TO_JSON(record, exclude_none=True) for record in records]
            _write_flush(self._follow_path(), b"\n".join(lines) + b"\n")
            self.written += len(records)

    def _follow_path(self) -> BinaryIO:
        """In the worker thread, before a batch: the file `trace_path` names now. One moved away
        (rotated) or removed is followed by a new one at the path, as logging's WatchedFileHandler
        does; before, every later record went into the moved file, or into the removed one (lost,
        yet counted written)."""
        handle = self._handle
        assert handle is not None
        try:
            named: os.stat_result | None = os.stat(self.path)
        except FileNotFoundError:
            named = None
        if named is not None and os.path.samestat(named, os.fstat(handle.fileno())):
            return handle
        self._handle = open_capture(self.path)
        handle.close()
        log.warning(
            "trace capture: the file was moved or removed; recording in a new one at its path",
            extra={"trace_path": str(self.path)},
        )
        return self._handle

    async def close(self) -> None:
        if self._task is None:
            return
        await self._queue.put(None)
        try:
            await asyncio.wait_for(self._task, 10)
        except Exception as exc:  # never let shut-down hang on a stuck disk
            log.error("trace writer did not finish", extra={"error": str(exc)})
        if self.dropped or self.invalid:
            log.warning(
                "trace capture dropped records",
                extra={"dropped": self.dropped, "invalid": self.invalid},
            )


def open_capture(path: Path) -> BinaryIO:
    """The capture file opened for appending (its directory made), a torn last record cut off."""
    handle = _open_append(path)
    try:
        _cut_torn_tail(handle, path)
    except OSError:
        handle.close()
        raise
    return handle


def _open_append(path: Path) -> BinaryIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("ab")


def _cut_torn_tail(handle: BinaryIO, path: Path) -> None:
    """A gateway killed while writing leaves its last record without its newline; the next one
    appended (the gateway restarted) joined it into a line that is not JSON, mid-capture, and
    `trace-to-multiturn` refused the whole capture. The torn record (which a conversion leaves
    out anyway) is cut back to the last whole line, and said; a last record that is whole JSON
    and lacks only its newline (a file edited by hand) is ended with one instead."""
    fd = handle.fileno()
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size == 0:  # /dev/full, a pipe: left alone
        return
    size = keep = info.st_size
    with path.open("rb") as reader:
        reader.seek(size - 1)
        if reader.read(1) == b"\n":
            return
        while keep > 0:  # back a block at a time to the last newline (0: none at all)
            start = max(0, keep - 65536)
            reader.seek(start)
            newline = reader.read(keep - start).rfind(b"\n")
            keep = start + newline + 1 if newline >= 0 else start
            if newline >= 0:
                break
        reader.seek(keep)
        tail = reader.read(min(size - keep, _MAX_WHOLE_TAIL + 1))
    if len(tail) <= _MAX_WHOLE_TAIL and _is_json(tail):
        _write_flush(handle, b"\n")
        return
    os.ftruncate(fd, keep)
    log.warning(
        "trace capture: the file ended mid-record (a gateway stopped while writing it); that "
        "record is cut off before appending",
        extra={"trace_path": str(path), "cut_bytes": size - keep},
    )


_MAX_WHOLE_TAIL = 1 << 20  # a last line longer than this is no record the gateway wrote


def _is_json(data: bytes) -> bool:
    try:
        json.loads(data)
    except ValueError:  # UnicodeDecodeError included
        return False
    return True


def check_trace_path(path: str) -> None:
    """A `trace_path` the gateway cannot append to as one settings error when the app is built
    (the CLI's one line, exit 2), not a traceback from the server's start-up."""
    try:
        _open_append(Path(path)).close()  # checked only: `start` cuts a torn record
    except OSError as exc:
        # mkdir says "File exists" of a file where a directory of the path should be
        why = f"{exc.filename} is not a directory" if isinstance(exc, FileExistsError) else None
        raise ValueError(
            f"invalid gateway settings: trace_path: cannot append to {path} "
            f"({why or exc.strerror or exc}); name a file in a writable directory"
        ) from exc


_CALLS = TypeAdapter(list[ToolCallRecord])
_CONVERTED = (
    "a PolyTrace multi-turn trajectory (trace-to-multiturn's output, or a published trace), not a "
    "capture line: it needs no converting; give it where a trace is read"
)
_TO_JSON = ToolCallRecord.__pydantic_serializer__.to_json


def _write_flush(handle, data: bytes) -> None:
    handle.write(data)
    handle.flush()


class TruncatedCapture(TraceFormatError):
    """The capture's last line stops mid-record: the gateway was killed while it wrote a batch.
    Raised after every whole line before it was read."""


@dataclass(frozen=True, slots=True)
class Converted:
    """What `to_multiturn` wrote, and the capture's torn last line it left out, if any."""

    trajectories: int
    torn_line: int | None = None


def read_captured_calls(path: str | Path) -> Iterator[ToolCallRecord]:
    """Read a capture file back (one `ToolCallRecord` per line); raises TraceFormatError naming
    the line and field of a line that is not one (the trace readers' own loop: a file that is not
    text names its line, and says when it is gzip-compressed), and TruncatedCapture for a last
    line without its newline that is not JSON."""
    with open_trace(path) as handle:
        for lineno, line in numbered_lines(handle, path):
            if not line.strip():
                continue
            try:
                raw = json_line(path, lineno, line)
            except TraceFormatError:
                if line.endswith("\n"):
                    raise
                problem = "stops mid-record (no newline, not JSON)"
                raise TruncatedCapture(path, lineno, "", problem) from None
            yield _captured_call(path, lineno, raw)


def _captured_call(path: str | Path, lineno: int, raw: object) -> ToolCallRecord:
    if isinstance(raw, dict) and "turns" in raw:  # it said "field 'turn': Field required"
        raise TraceFormatError(path, lineno, "", _CONVERTED)
    try:
        record = ToolCallRecord.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        problem = f"{first['msg']} (not a trace capture line)"
        raise TraceFormatError(path, lineno, field, problem) from exc
    if record.trajectory_id is None:  # optional in a published call, which is grouped by it here
        problem = "Field required (not a trace capture line: the gateway writes each call's id)"
        raise TraceFormatError(path, lineno, "trajectory_id", problem)
    return record


def to_multiturn(capture: str | Path, out: str | Path | TextIO) -> Converted:
    """Group a capture file by (trajectory, step) into PolyTrace multi-turn lines.

    Turns the gateway never saw (generation) are filled with zero token counts: what replays is
    the tool calls, per turn, in order. `out` is a path or an open text stream (stdout for `-`).
    A torn last line (a gateway killed mid-write) is left out
    and named: the whole capture was refused for it.
    """
    groups: dict[tuple[str, int], list[ToolCallRecord]] = {}
    torn_line: int | None = None
    try:
        for record in read_captured_calls(capture):
            key = (record.trajectory_id or "", record.step or 0)
            groups.setdefault(key, []).append(record)
    except TruncatedCapture as exc:
        torn_line = exc.line
    if not groups:  # an empty trace written, "wrote 0", exit 0: each reader of it said "empty"
        raise TraceFormatError(
            capture,
            0,
            "",
            "holds no tool calls (the gateway records each call that carries X-Trajectory-Id)",
        )
    opened = (
        nullcontext(out)
        if not isinstance(out, str | Path)
        else Path(out).open("w", encoding="utf-8")
    )
    with opened as handle:
        for (trajectory_id, step), calls in groups.items():
            turns = sorted({c.turn for c in calls})
            trajectory = TrajectoryRecord(
                step=step,
                prompt_len=0,
                turns=[
                    TurnRecord(
                        turn=t,
                        prompt_tokens=0,
                        completion_tokens=0,
                        finish_reason="tool_calls",
                        tool_call_count=sum(1 for c in calls if c.turn == t),
                    )
                    for t in turns
                ],
                tool_calls=calls,
                tool_call_count=len(calls),
                trajectory_id=trajectory_id,
            )
            handle.write(trajectory.model_dump_json(by_alias=True, exclude_none=True) + "\n")
    return Converted(len(groups), torn_line)
