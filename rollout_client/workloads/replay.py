"""PolyTrace multi-turn replay: each recorded trajectory becomes a plan with the same shape.

Per trajectory: the prompt length, each turn's output length (forced with min_tokens =
max_tokens and ignore_eos), one tool call per recorded call after its turn, and the recorded
response length (`append_len`, else `response_token_len`) appended to the context. A call that
records none (a gateway capture converted by `trace-to-multiturn`) appends nothing and lets the
emulator size its reply: it takes a `response_tokens` of 1 or more (0 was a 422 on every call).

Exact mode (`exact=True`) sends each call's recorded latency as `delay_s`: the search emulator
sleeps exactly that long, so the replay reproduces the very latency of that very call. Otherwise
the emulator draws the latency from its own model.

With the simulated engine running `time_scale` times faster than its cost model, exact mode
sends `latency_s / time_scale`, so generation and tools are compressed alike.

Scaling for small models (`LengthScale`): every length is multiplied by `factor` (rounded up,
at least 1 token for outputs) and then capped (`max_prompt`, `max_output`, `max_append`), so a
trace recorded with a 7B model and 7k-token contexts runs on a tiny CPU model in seconds while
keeping the turn structure; the output records carry the scaled lengths, so they stay exact.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from toolenv_core.polytrace import TrajectoryRecord, read_multiturn

from .plan import ToolCallPlan, TrajectoryPlan, TurnPlan


@dataclass(frozen=True, slots=True)
class LengthScale:
    factor: float = 1.0
    max_prompt: int | None = None
    max_output: int | None = None
    max_append: int | None = None

    def _apply(self, n: int, cap: int | None, floor: int) -> int:
        # at most 2^62: a factor of 1e308 made an infinite length, an OverflowError traceback
        # where a trajectory too long to hold is refused (`plan.MAX_CONTEXT_TOKENS`); rounded to
        # 1e-6 before rounding up: 100 x 1.1 is 110.00000000000001 in floating point, made 111
        exact = round(min(n * self.factor, 2.0**62), 6)
        scaled = max(floor, math.ceil(exact)) if n > 0 else floor
        return min(scaled, cap) if cap is not None else scaled

    def prompt(self, n: int) -> int:
        return self._apply(n, self.max_prompt, 1)

    def output(self, n: int) -> int:
        return self._apply(n, self.max_output, 1)

    def append(self, n: int) -> int:
        return self._apply(n, self.max_append, 0)


def plan_from_record(
    record: TrajectoryRecord,
    index: int,
    scale: LengthScale = LengthScale(),
    exact: bool = False,
    topk: int = 3,
    delay_scale: float = 1.0,
) -> TrajectoryPlan:
    sample = record.sample_id if record.sample_id is not None else index
    group = record.prompt_group_id if record.prompt_group_id is not None else index
    tid = f"s{record.step}-g{group}-i{sample}-{index}"
    turns: list[TurnPlan] = []
    for turn in sorted(record.turns, key=lambda t: t.turn):
        calls = []
        for k, call in enumerate(record.tool_calls_after(turn.turn)):
            recorded = (
                call.append_len if call.append_len is not None else (call.response_token_len or 0)
            )
            count = max(1, call.query_count or 1)
            queries = [f"polytrace {tid} turn {turn.turn} call {k} query {q}" for q in range(count)]
            arguments: dict = {"query": queries[0]} if count == 1 else {"queries": queries}
            arguments["topk"] = topk
            append = scale.append(recorded)
            if append > 0:  # the emulator sizes a response of 1 or more; 0 is its own size
                arguments["response_tokens"] = append
            if exact:
                arguments["delay_s"] = call.latency_s * delay_scale
            calls.append(
                ToolCallPlan(
                    call.tool_name,
                    arguments,
                    append,
                    recorded_latency_s=call.latency_s,
                    query_count=count,
                )
            )
        turns.append(
            TurnPlan(scale.output(turn.completion_tokens), calls, finish_reason=turn.finish_reason)
        )
    return TrajectoryPlan(
        tid,
        scale.prompt(record.prompt_len),
        turns,
        source={"step": record.step, "prompt_group_id": group, "sample_id": sample},
    )


def replay_plans(
    paths: Iterable[str | Path],
    *,
    scale: LengthScale = LengthScale(),
    exact: bool = False,
    limit: int | None = None,
    sample: float | None = None,
    seed: int = 0,
    delay_scale: float = 1.0,
) -> Iterator[TrajectoryPlan]:
    """Plans from PolyTrace files, streamed; `sample` keeps each trajectory with that probability."""
    rng = random.Random(seed)
    n = 0
    index = 0
    for path in paths:
        for record in read_multiturn(path):
            index += 1
            if sample is not None and rng.random() >= sample:
                continue
            if limit is not None and n >= limit:
                return
            yield plan_from_record(record, index - 1, scale, exact, delay_scale=delay_scale)
            n += 1
