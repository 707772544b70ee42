"""What a workload hands the runner: per trajectory, the prompt and what each turn must do.

A plan is engine- and policy-free: prompt token ids, each turn's forced output length, and the
tool calls that follow the turn (with the arguments to send and how many tokens the response
appends to the context). Replay, synthetic and live workloads all produce plans.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_CONTEXT_TOKENS = 1 << 20
"""Tokens one trajectory's context may reach: its prompt, every turn's output, every tool response.

The runner holds each context as a list of token ids whatever the engine (the simulator too, 8
bytes a token), and no engine it drives holds a longer sequence: 2^20 is the longest context of
today's deployed models, about 90x the longest replayed search_r1 trajectory (11,725 tokens) or
intern_s1 one drawn (about 12,000). A selection that outgrows it is refused before the run.
"""


@dataclass
class ToolCallPlan:
    tool: str
    arguments: dict[str, Any]
    append_tokens: int  # tokens the response adds to the context
    recorded_latency_s: float | None = None
    query_count: int | None = None
    live_error: str | None = None  # live mode: why the model's call could not be parsed


@dataclass(slots=True)
class TurnPlan:
    output_tokens: int
    calls: list[ToolCallPlan] = field(default_factory=list)
    finish_reason: str = "stop"
    forced: bool = True  # replay/synthetic: exactly output_tokens; live: up to it, EOS may stop it


@dataclass
class TrajectoryPlan:
    trajectory_id: str
    prompt_len: int
    turns: list[TurnPlan]
    source: dict[str, Any] = field(default_factory=dict)  # ids of the record it came from
    prompt_ids: list[int] | None = None  # live mode: the real tokenized prompt (else synthetic)

    @property
    def output_tokens(self) -> int:
        return sum(t.output_tokens for t in self.turns)

    @property
    def context_tokens(self) -> int:
        """Tokens its context reaches if every call answers: what `MAX_CONTEXT_TOKENS` bounds."""
        appended = sum(call.append_tokens for turn in self.turns for call in turn.calls)
        return self.prompt_len + self.output_tokens + appended


@dataclass(frozen=True, slots=True)
class TokenSynth:
    """Deterministic token ids inside the model's vocabulary (PolyTrace publishes no text).

    The same key always gives the same ids, so a replay is reproducible and a trajectory's
    context is a stable prefix from turn to turn (what the prefix cache needs). Ids below
    `low` are left out: tokenizers keep their special tokens there.
    """

    vocab_size: int = 1024
    low: int = 16
    lengths_only: bool = False  # simulated engines read only lengths: one repeated id, no RNG

    def ids(self, key: str, n: int) -> list[int]:
        if n <= 0:
            return []
        if self.lengths_only:
            return [self.low] * n
        rng = np.random.default_rng(zlib.crc32(key.encode()))
        return rng.integers(self.low, self.vocab_size, size=n).tolist()
