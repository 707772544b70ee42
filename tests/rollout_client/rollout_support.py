"""Helpers for the rollout_client tests: a fake tool client (policy unit tests only) and plans."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from testkit import ServerProcess, free_port

from rollout_client.gateway_client import ToolOutcome
from rollout_client.workloads.plan import ToolCallPlan, TrajectoryPlan, TurnPlan


class FakeTools:
    """Stands in for the gateway in policy unit tests: sleeps `delay_s`, honours the deadline."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, float]] = []

    async def call(
        self, tool, arguments, *, deadline=None, trajectory_id="", step=0, turn=0
    ) -> ToolOutcome:
        started = time.monotonic()
        self.calls.append((trajectory_id, turn, started))
        delay = float(arguments.get("delay_s", 0.0))
        if tool == "broken":
            return ToolOutcome("error", 0.0, error="tool failed")
        if deadline is not None and delay > deadline.remaining():
            await asyncio.sleep(deadline.remaining())
            return ToolOutcome("timeout", time.monotonic() - started, error="deadline")
        await asyncio.sleep(delay)
        return ToolOutcome("ok", time.monotonic() - started)

    async def close(self) -> None:
        pass


def plan(
    tid: str,
    prompt: int,
    turns: list[tuple[int, float | None]],
    append: int = 8,
    tool: str = "search",
) -> TrajectoryPlan:
    """turns: (output tokens, tool delay after the turn or None for no call)."""
    out = []
    for i, (tokens, delay) in enumerate(turns):
        calls = []
        if delay is not None:
            calls.append(
                ToolCallPlan(
                    tool,
                    {"query": f"{tid} {i}", "delay_s": delay},
                    append,
                    recorded_latency_s=delay,
                )
            )
        out.append(TurnPlan(tokens, calls, "tool_calls" if calls else "stop"))
    return TrajectoryPlan(tid, prompt, out)


def start_gateway() -> ServerProcess:
    """The real embedded service (`toolenv serve`: gateway + search emulator) on a free port."""
    port = free_port()
    argv = [sys.executable, "-m", "toolenv", "serve", "--host", "127.0.0.1", "--port", str(port)]
    return ServerProcess(argv, f"http://127.0.0.1:{port}").start("/readyz", timeout=60)


def write_trace(records: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def first_records(polytrace_dir: Path, n: int, min_turns: int = 2) -> list[dict]:
    """The first n multi-turn trajectories of search_r1 step 0 (raw dicts)."""
    out = []
    with (polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl").open() as f:
        for line in f:
            record = json.loads(line)
            if len(record["turns"]) >= min_turns:
                out.append(record)
            if len(out) == n:
                break
    return out


def endless_cost_profile(path: Path) -> Path:
    """An engine cost profile whose iterations take 1e308 s: past the virtual clock's horizon."""
    costs = {"prefill_per_token_s": 1e308, "decode_base_s": 1, "decode_per_seq_s": 1}
    path.write_text(json.dumps(costs))
    return path


def sigterm_once(argv: list[str], ready: Callable[[], bool], what: str) -> tuple[int, str]:
    """Start `argv`, send it SIGTERM once `ready()` holds (60 s at most: `what` did not happen),
    and return its exit status and stderr."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"{what} never happened"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    return proc.returncode, stderr
