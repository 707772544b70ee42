"""Typed PolyTrace multi-turn records (the Search-R1 `multiturn_workload_step_N.jsonl` shape).

Unknown fields are kept (`extra="allow"`) so that a record read and written back loses nothing.
Fields the replay needs are required; the rest are optional so that our own writers (rollout
client, gateway trace capture) can emit what they know.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import InitErrorDetails, PydanticCustomError


class _Record(BaseModel):
    model_config = ConfigDict(extra="allow")


def _problem_at(where: tuple[int | str, ...], problem: str, value: Any) -> ValidationError:
    """A problem at `where` inside the field a validator checks (pydantic puts the field first),
    so that a reader's error names the very item: `tool_calls.2.turn`, not `tool_calls`."""
    error = PydanticCustomError("trajectory", "{problem}", {"problem": problem})
    details = InitErrorDetails(type=error, loc=where, input=value)
    return ValidationError.from_exception_data("TrajectoryRecord", [details])


class TurnRecord(_Record):
    turn: int = Field(ge=0)
    prompt_tokens: int = Field(ge=0, description="prompt length this turn was generated from")
    completion_tokens: int = Field(ge=0, description="tokens the engine generated this turn")
    finish_reason: str = Field(description='"tool_calls" | "stop" | "length"')
    tool_call_count: int = Field(default=0, ge=0)
    generation_prompt_len: int | None = None
    cached_tokens: int | None = None
    max_new_tokens: int | None = None
    assistant_append_len: int | None = None
    total_len_after: int | None = None
    engine_latency_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class ToolCallRecord(_Record):
    turn: int = Field(ge=0)
    tool_name: str
    latency_s: float = Field(ge=0, allow_inf_nan=False)
    status: str = "success"
    query_count: int | None = None
    response_token_len: int | None = Field(default=None, ge=0)
    append_len: int | None = Field(default=None, ge=0, description="tokens appended to the context")
    loss_len: int | None = None
    total_results: int | None = None
    # Written by toolenv (gateway trace capture, rollout client); absent in published traces.
    trajectory_id: str | None = None
    step: int | None = Field(default=None, ge=0)  # a trajectory's step (TrajectoryRecord: >= 0)
    response_bytes: int | None = None
    error: str | None = None  # why the call failed (rollout client)
    recorded_latency_s: float | None = None  # replay: what the trace recorded for this call


class TrajectoryRecord(_Record):
    step: int = Field(ge=0)
    prompt_len: int = Field(ge=0)
    turns: list[TurnRecord]
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    finish_reason: str | None = None
    max_response_len: int | None = None
    max_model_len: int | None = None
    turn_count: int | None = None
    tool_call_count: int | None = None
    final_total_len: int | None = None
    final_response_len: int | None = None
    prompt_group_id: int | None = None
    sample_id: int | None = None
    validate_: bool | None = Field(default=None, alias="validate")
    # Written by toolenv (gateway trace capture, rollout client); absent in published traces.
    trajectory_id: str | None = None
    launched_step: int | None = None
    staleness: int | None = None
    policy: str | None = None
    source: dict[str, Any] | None = None

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    @field_validator("turns")
    @classmethod
    def _turns_to_replay(cls, turns: list[TurnRecord]) -> list[TurnRecord]:
        """A replay runs each turn once, in order: a trajectory with none would "finish" at time
        0 without a generation."""
        if not turns:
            raise ValueError("the trajectory has no turn: it needs at least its first generation")
        seen: dict[int, int] = {}
        for i, turn in enumerate(turns):  # both were replayed, each with all of that turn's calls
            if turn.turn in seen:
                problem = f"turn {turn.turn} is given twice (turns.{seen[turn.turn]} and turns.{i})"
                raise _problem_at((i, "turn"), problem, turn.turn)
            seen[turn.turn] = i
        return turns

    @field_validator("tool_calls")
    @classmethod
    def _calls_follow_turns(
        cls, calls: list[ToolCallRecord], info: ValidationInfo
    ) -> list[ToolCallRecord]:
        """Each call follows the turn that made it: one after a turn the trajectory lacks was
        left out of the replay (and kept in the recorded timings `rollout validate` compares)."""
        turns = sorted({t.turn for t in info.data.get("turns") or []})
        for i, call in enumerate(calls):
            if turns and call.turn not in turns:
                listed = ", ".join(map(str, turns))
                problem = f"the trajectory has no turn {call.turn} (its turns: {listed})"
                raise _problem_at((i, "turn"), problem, call.turn)
        return calls

    def tool_calls_after(self, turn: int) -> list[ToolCallRecord]:
        """The tool calls made at the end of `turn` (their responses feed turn + 1)."""
        return [c for c in self.tool_calls if c.turn == turn]
