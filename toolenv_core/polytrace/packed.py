"""Packed lengths (`packed_lengths_step_N.jsonl` of verl_dapo, verl_video, rllm_deepcoder).

One record per prompt as the trainer packed it: prompt length and the n sampled response lengths.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .jsonl import read_jsonl


class PackedLengthsRecord(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    step: int = Field(ge=0)
    rank: int = Field(ge=0)
    dp_rank: int = Field(ge=0)
    tp_rank: int = Field(ge=0)
    local_index: int = Field(ge=0)
    input: int = Field(ge=0, description="prompt tokens")
    output: list[int] = Field(description="response lengths, one per sample")
    n_sampling: int = Field(ge=1)
    validate_: bool = Field(default=False, alias="validate")

    @field_validator("output")
    @classmethod
    def _lengths_are_tokens(cls, value: list[int]) -> list[int]:
        if any(n < 0 for n in value):
            raise ValueError("output lengths must be non-negative token counts")
        return value


def read_packed_lengths(path: str | Path) -> Iterator[PackedLengthsRecord]:
    """Stream the prompts of one packed-lengths file, in file order."""
    return read_jsonl(path, PackedLengthsRecord)
