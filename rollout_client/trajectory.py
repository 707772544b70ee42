"""One trajectory's live state across turns and steps, and its PolyTrace output record."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from toolenv_core.polytrace import ToolCallRecord, TrajectoryRecord, TurnRecord

from .workloads.plan import TokenSynth, TrajectoryPlan

Status = Literal["running", "done", "carried", "aborted", "failed"]


@dataclass(eq=False)
class StepTimes:
    """Seconds this trajectory spent, within one step, in each state."""

    generate_s: float = 0.0  # first token to last token
    queue_s: float = 0.0  # submitted to first token (batch slot wait + prefill)
    tool_s: float = 0.0
    barrier_s: float = 0.0  # waiting for the rest of the batch (sync)
    tokens: int = 0

    def add(self, other: StepTimes) -> None:
        self.generate_s += other.generate_s
        self.queue_s += other.queue_s
        self.tool_s += other.tool_s
        self.barrier_s += other.barrier_s
        self.tokens += other.tokens


@dataclass(eq=False)
class TrajectoryState:
    plan: TrajectoryPlan
    launched_step: int
    synth: TokenSynth
    context: list[int] = field(default_factory=list)
    next_turn: int = 0
    calls_done: int = 0  # tool calls already made after `next_turn`'s generation
    in_call: bool = False  # waiting on a tool call now (a step closing here abandons it)
    generated: bool = False  # `next_turn`'s generation is complete
    partial: list[int] = field(default_factory=list)  # tokens of an interrupted generation
    attempts: int = 0
    status: Status = "running"
    turns: list[TurnRecord] = field(default_factory=list)
    calls: list[ToolCallRecord] = field(default_factory=list)
    generated_tokens: int = 0
    steps_run: int = 0
    finished_step: int | None = None
    finished_at: float | None = None  # seconds since its final step started
    timeouts: int = 0
    tool_errors: int = 0
    error: str | None = None
    times: StepTimes = field(default_factory=StepTimes)
    total_times: StepTimes = field(default_factory=StepTimes)

    def __post_init__(self) -> None:
        if not self.context:
            self.context = self.plan_prompt()

    @property
    def trajectory_id(self) -> str:
        return self.plan.trajectory_id

    def plan_prompt(self) -> list[int]:
        if self.plan.prompt_ids is not None:  # live prompts are real text
            return list(self.plan.prompt_ids)
        return self.synth.ids(f"{self.trajectory_id}/prompt", self.plan.prompt_len)

    @property
    def staleness(self) -> int:
        """Policy versions between launch and completion (0: done in the step it started)."""
        end = self.finished_step if self.finished_step is not None else self.launched_step
        return end - self.launched_step

    def new_step(self) -> None:
        self.total_times.add(self.times)
        self.times = StepTimes()

    def to_record(self, policy: str) -> TrajectoryRecord:
        """The PolyTrace multi-turn record of what actually ran (replayable as is)."""
        total = len(self.context)
        return TrajectoryRecord(
            step=self.finished_step if self.finished_step is not None else self.launched_step,
            prompt_len=self.plan.prompt_len,
            turns=self.turns,
            tool_calls=self.calls,
            finish_reason=self.turns[-1].finish_reason if self.turns else None,
            turn_count=len(self.turns),
            tool_call_count=len(self.calls),
            final_total_len=total,
            final_response_len=total - self.plan.prompt_len,
            prompt_group_id=self.plan.source.get("prompt_group_id"),
            sample_id=self.plan.source.get("sample_id"),
            trajectory_id=self.trajectory_id,
            launched_step=self.launched_step,
            staleness=self.staleness,
            policy=policy,
            source=self.plan.source,
        )
