"""Tool latencies from any PolyTrace file, in replay order (step, trajectory, turn).

The fitter, `describe --data`, the trace-replay latency model and the bench all take "a trace" and
want one tool's latencies; this module finds the format of each file and streams them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .calllog import MARKER, read_call_log
from .errors import TraceFormatError
from .jsonl import open_trace, sorted_by_step
from .multiturn import read_multiturn
from .rewards import read_reward_timings

FORMATS = (
    "multiturn",
    "reward_timings",
    "packed_lengths",
    "dapo_filter",
    "fitted_parameters",
    "call_log",
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


def detect_format(path: str | Path) -> str:
    """Look at the first non-empty line and name the PolyTrace format of the file."""
    p = Path(path)
    with open_trace(p) as handle:
        for scanned, line in enumerate(handle):
            text = line.strip()
            if MARKER in text:
                return "call_log"
            if not text or scanned > 1000:
                if scanned > 1000:
                    break
                continue
            if text == "{":
                return "fitted_parameters"
            if not text.startswith("{"):
                continue  # other log output before the first call record
            try:
                raw = json.loads(text)
            except json.JSONDecodeError:
                break
            if isinstance(raw, dict):
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
            break
    raise TraceFormatError(
        p, 1, "", f"not a PolyTrace file this project reads (one of: {', '.join(FORMATS)})"
    )


def expand_paths(paths: Iterable[str | Path]) -> list[Path]:
    """Files as given; a directory stands for its `*.jsonl` and `*.log` files."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            out.extend(sorted([*p.glob("*.jsonl"), *p.glob("*.log")]))
        else:
            out.append(p)
    return out


def iter_latencies(
    paths: Iterable[str | Path], tool: str = "search"
) -> Iterator[LatencyObservation]:
    """Stream one tool's calls from multi-turn traces, call logs, or (tool `reward`) reward timings.

    Files that record no latencies (packed lengths, filter indices) are skipped, so a whole
    PolyTrace directory can be given.
    """
    for path in sorted_by_step(expand_paths(paths)):
        fmt = detect_format(path)
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
                        )
        elif fmt == "call_log":
            for index, rec in enumerate(read_call_log(path)):
                if rec.tool == tool:
                    yield LatencyObservation(rec.step, index, 0, rec.latency_s)
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
                )
        # packed lengths, DAPO filter indices and fitted parameters record no latencies: skipped


def tool_latencies(paths: Iterable[str | Path], tool: str = "search") -> np.ndarray:
    """All of one tool's latencies (seconds) in replay order."""
    paths = list(paths)
    values = np.fromiter((o.latency_s for o in iter_latencies(paths, tool)), dtype=float)
    if values.size == 0:
        names = ", ".join(str(p) for p in expand_paths(paths))
        raise ValueError(f"no calls of tool {tool!r} in {names}")
    return values
