"""DAPO dynamic-filter indices (`dapo_filter_indices.jsonl` of verl_dapo)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from .jsonl import read_jsonl


class DapoFilterRecord(BaseModel):
    """Which prompts of one generation batch survived the filter, and which the trainer used."""

    model_config = ConfigDict(extra="allow")

    workload_step: int = Field(ge=0)
    trainer_step: int = Field(ge=0)
    gen_batch_index: int = Field(ge=0)
    prompt_count: int = Field(ge=0)
    n_sampling: int = Field(ge=1)
    train_batch_size: int = Field(ge=1)
    num_prompt_in_batch_before: int = Field(ge=0)
    kept_prompt_count: int = Field(ge=0)
    used_prompt_count: int = Field(ge=0)
    kept_prompt_indices: list[int]
    used_prompt_indices: list[int]

    @field_validator("kept_prompt_indices")
    @classmethod
    def _counts_match(cls, value: list[int], info: ValidationInfo) -> list[int]:
        count = info.data.get("kept_prompt_count")
        if count is not None and len(value) != count:
            raise ValueError(f"has {len(value)} entries but kept_prompt_count says {count}")
        prompts = info.data.get("prompt_count")
        if prompts is not None and any(not 0 <= i < prompts for i in value):
            raise ValueError(f"indices must lie in [0, prompt_count={prompts})")
        return value


def read_dapo_filter(path: str | Path) -> Iterator[DapoFilterRecord]:
    """Stream the filter decisions, one generation batch per record."""
    return read_jsonl(path, DapoFilterRecord)
