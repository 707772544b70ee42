"""Reward timings (`reward_timings_step_N.jsonl` of rllm_deepcoder): sandbox time per batch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from .kinds import read_kind


class RewardTimingRecord(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    step: int = Field(ge=0)
    rank: int = Field(ge=0)
    dp_rank: int = Field(ge=0)
    tp_rank: int = Field(ge=0)
    batch_size: int = Field(ge=1, description="responses verified in this batch")
    reward_time_s: float = Field(ge=0, description="wall time the code sandbox took for the batch")
    response_sum: int = Field(ge=0)
    response_mean: float = Field(ge=0)
    response_max: int = Field(ge=0)
    validate_: bool = Field(default=False, alias="validate")


def read_reward_timings(path: str | Path) -> Iterator[RewardTimingRecord]:
    """Stream one reward-timings file, in file order; one that holds none raises
    `TraceFormatError` naming it (`read_kind`)."""
    return read_kind(path, RewardTimingRecord, "reward_timings", "holds no reward timings")
