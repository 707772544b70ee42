"""Tool latencies from any PolyTrace file, in replay order (step, trajectory, turn).

The fitter, `describe --data`, the trace-replay latency model and the bench all take "a trace" and
want one tool's latencies; this module finds the format of each file and streams them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .cache import resolve_traces
from .calllog import read_call_log
from .errors import CaptureNotTrace, TraceFormatError
from .jsonl import sorted_by_step
from .kinds import FORMATS, detect_format, expand_paths, holdings, kind_of_file
from .multiturn import read_multiturn
from .rewards import read_reward_timings

__all__ = ["FORMATS", "LatencyObservation", "detect_format", "expand_paths", "iter_latencies"]


NOT_A_FILE = (
    "not a regular file (a pipe, such as `<(zcat TRACE.gz)`?): it is read twice, its kind "
    "first, and a pipe read again goes on where the first read stopped; write it to a file "
    "first (`zcat TRACE.gz > TRACE.jsonl`)"
)


@dataclass(frozen=True, slots=True)
class LatencyObservation:
    """One recorded call: where it sits in the run and how long it took."""

    step: int
    trajectory: int  # index of the trajectory (or batch) within its step's file
    turn: int
    latency_s: float
    response_tokens: int | None = None
    query_count: int | None = None
    batch_size: int | None = None
    response_sum: int | None = None
    status: str | None = None  # multi-turn: the call's `status` ("success", "timeout", ...)
    source: Path | None = None  # the file it was read from (what a fitted profile names)


def iter_latencies(
    paths: Iterable[str | Path], tool: str = "search"
) -> Iterator[LatencyObservation]:
    """Stream one tool's calls from multi-turn traces, call logs, or (tool `reward`) reward timings.

    Files that record no latencies (packed lengths, filter indices) are skipped, so a whole
    PolyTrace directory can be given; so are a directory's gateway captures (a capture named as a
    file raises `CaptureNotTrace`, which says how to convert it).
    """
    paths = list(paths)
    named = {p for p in resolve_traces(paths) if not p.is_dir()}
    for path in sorted_by_step(expand_paths(paths)):
        if not path.is_file():  # its kind is read first, then its calls from a second open
            raise TraceFormatError(path, 0, "", NOT_A_FILE)
        try:
            fmt = detect_format(path)
        except CaptureNotTrace:
            if path in named:
                raise
            continue  # a folder's capture: the trace made of it beside it is read instead
        if fmt == "multiturn":
            for index, traj in enumerate(read_multiturn(path)):
                for call in sorted(traj.tool_calls, key=lambda c: c.turn):
                    if call.tool_name == tool:
                        yield LatencyObservation(
                            traj.step,
                            index,
                            call.turn,
                            call.latency_s,
                            call.response_token_len,
                            call.query_count,
                            status=call.status,
                            source=path,
                        )
        elif fmt == "call_log":
            for index, rec in enumerate(read_call_log(path)):
                if rec.tool == tool:
                    yield LatencyObservation(rec.step, index, 0, rec.latency_s, source=path)
        elif fmt == "reward_timings":
            if tool != "reward":
                continue
            for index, rec in enumerate(read_reward_timings(path)):
                yield LatencyObservation(
                    rec.step,
                    index,
                    0,
                    rec.reward_time_s,
                    batch_size=rec.batch_size,
                    response_sum=rec.response_sum,
                    source=path,
                )
        # packed lengths, DAPO filter indices and fitted parameters record no latencies: skipped


def tool_latencies(
    paths: Iterable[str | Path], tool: str = "search", *, chooser: str = "--tool"
) -> np.ndarray:
    """All of one tool's latencies (seconds) in replay order; `chooser`: as `no_calls_message`."""
    paths = list(paths)
    values = np.fromiter((o.latency_s for o in iter_latencies(paths, tool)), dtype=float)
    if values.size == 0:
        raise ValueError(no_calls_message(paths, tool, chooser))
    return values


def no_calls_message(paths: Iterable[str | Path], tool: str, chooser: str = "--tool") -> str:
    """Why a trace selection gave no calls of a tool: what the files hold and who reads it.
    `chooser`: what names the tool where the caller is (a profile has no `--tool` option)."""
    paths = list(paths)
    files = expand_paths(paths)
    if not files:  # directories without a trace file (the message read "in : no files")
        given = ", ".join(str(p) for p in paths)
        # intern_s1's fitted parameters (.json) read as "no .jsonl or .log files there"
        held = [f for d in resolve_traces(paths) if d.is_dir() for f in sorted(d.glob("*.json"))]
        what = holdings(held) if held else "no .jsonl or .log files there"
        return f"no calls of tool {tool!r} in {given}: {what}"
    names = ", ".join(str(p) for p in files[:3]) + (
        f" and {len(files) - 3} more" if len(files) > 3 else ""
    )
    message = f"no calls of tool {tool!r} in {names}: {holdings(files) or 'no files'}"
    others = sorted(recorded_tools(files) - {tool})
    if others:  # a misspelt --tool read like a wrong file
        message += f"; the tools recorded there: {', '.join(others)} ({chooser} names one)"
    return message


def recorded_tools(files: Iterable[Path]) -> set[str]:
    """The tool names the files record calls of (`reward` for reward timings)."""
    tools: set[str] = set()
    for path in files:
        fmt = kind_of_file(path)
        if fmt == "multiturn":
            tools.update(c.tool_name for t in read_multiturn(path) for c in t.tool_calls)
        elif fmt == "call_log":
            tools.update(rec.tool for rec in read_call_log(path))
        elif fmt == "reward_timings":
            tools.add("reward")
    return tools
