"""Trace capture: every call that carries `X-Trajectory-Id` becomes one PolyTrace tool-call line.

Each line is an `toolenv_core.polytrace.records.ToolCallRecord` (the multi-turn `tool_calls[]`
shape: tool_name, turn, latency_s, status, response_bytes, trajectory_id, step), so a workload
recorded through the gateway replays with the emulators: `to_multiturn` groups the calls of each
trajectory into one multi-turn `TrajectoryRecord` line, which `toolenv_core.polytrace` reads like a
published trace (`toolenv gateway trace-to-multiturn CAPTURE OUT`). Lines are queued in memory and written by a worker thread in batches:
the event loop never waits on the disk.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import anyio

from toolenv_core.polytrace.records import ToolCallRecord, TrajectoryRecord, TurnRecord

log = logging.getLogger("toolenv.gateway")


class TraceWriter:
    def __init__(self, path: str | Path, max_pending: int = 100_000) -> None:
        self.path = Path(path)
        self._queue: asyncio.Queue[str | None] = asyncio.Queue(maxsize=max_pending)
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0
        self.written = 0

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._task = asyncio.create_task(self._run(), name="trace-writer")

    def record(self, record: ToolCallRecord) -> None:
        """Queue one record (never blocks; a full queue drops and counts rather than stall calls)."""
        try:
            self._queue.put_nowait(record.model_dump_json(exclude_none=True))
        except asyncio.QueueFull:
            self.dropped += 1

    async def _run(self) -> None:
        handle = await anyio.to_thread.run_sync(lambda: self.path.open("a", encoding="utf-8"))
        try:
            stop = False
            while not stop:
                lines = [await self._queue.get()]
                while not self._queue.empty():
                    lines.append(self._queue.get_nowait())
                if None in lines:
                    stop = True
                    lines = [line for line in lines if line is not None]
                if lines:
                    text = "\n".join(lines) + "\n"
                    await anyio.to_thread.run_sync(_write_flush, handle, text)
                    self.written += len(lines)
        finally:
            await anyio.to_thread.run_sync(handle.close)

    async def close(self) -> None:
        if self._task is None:
            return
        await self._queue.put(None)
        try:
            await asyncio.wait_for(self._task, 10)
        except Exception as exc:  # never let shut-down hang on a stuck disk
            log.error("trace writer did not finish", extra={"error": str(exc)})
        if self.dropped:
            log.warning("trace capture dropped records", extra={"dropped": self.dropped})


def _write_flush(handle, text: str) -> None:
    handle.write(text)
    handle.flush()


def parse_int_header(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        return None
    return number if number >= 0 else None


def read_captured_calls(path: str | Path) -> Iterator[ToolCallRecord]:
    """Read a capture file back (one `ToolCallRecord` per line)."""
    with Path(path).open(encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                yield ToolCallRecord.model_validate(json.loads(line))


def to_multiturn(capture: str | Path, out: str | Path) -> int:
    """Group a capture file by (trajectory, step) into PolyTrace multi-turn lines; returns the count.

    Turns the gateway never saw (generation) are filled with zero token counts: what replays is
    the tool calls, per turn, in order.
    """
    groups: dict[tuple[str, int], list[ToolCallRecord]] = {}
    for record in read_captured_calls(capture):
        key = (record.trajectory_id or "", record.step or 0)
        groups.setdefault(key, []).append(record)
    with Path(out).open("w", encoding="utf-8") as handle:
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
    return len(groups)
