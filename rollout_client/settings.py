"""Rollout client settings (env prefix `TOOLENV_ROLLOUT_`, config-file section `rollout`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from toolenv_core.config import ServiceSettings
from toolenv_core.fields import Integer, Number

# Real runs per policy and workload in `calibrate --check` (their medians are compared). Single
# runs on a shared 2-core machine differ by up to 2x; with 5 the median was a loaded run often
# enough to move a policy's accuracy by 10-20 points (docs/rollout.md, "Against a real engine").
CHECK_ROUNDS = 9

MAX_OVERLAP_RATIO = 100.0  # over-sampling launches N * (1 + ratio) a step: 101 N at most


class RolloutSettings(ServiceSettings):
    model_config = SettingsConfigDict(
        env_prefix="TOOLENV_ROLLOUT_", extra="ignore", env_nested_delimiter="__"
    )
    section: ClassVar[str] = "rollout"

    gateway_url: str = "http://127.0.0.1:8080"
    engine: Literal["vllm", "openai", "sim"] = "sim"
    model: str | None = Field(
        default=None, description="model directory (vllm engine; vocab size for sim)"
    )
    openai_urls: list[str] = Field(
        default_factory=list,
        description="OpenAI-compatible servers (openai engine)",
        examples=[["http://127.0.0.1:8000"]],
    )
    openai_capacity: Integer = Field(
        default=64, ge=1, description="max sequences per server (occupancy denominator)"
    )
    cost_profile: str = Field(
        default="searchr1-qwen7b", description="sim cost model: built-in name or JSON file"
    )
    clock: Literal["wall", "virtual"] = Field(
        default="wall",
        description="sim: wall (real time, real tools via the gateway) or virtual (simulated clock, "
        "tools in process)",
    )
    tool_profiles: dict[str, str] = Field(
        default_factory=dict,
        description="virtual clock: latency profile file per tool (else recorded latencies, --exact)",
        examples=[{"search": "search_default"}],
    )
    tool_scale: Number = Field(
        default=1.0, gt=0, description="virtual clock: multiply every tool latency"
    )
    hedge_quantile: Number = Field(
        default=0.95, gt=0, lt=1, description="hedge policy: second attempt after this quantile"
    )
    time_scale: Number = Field(
        default=1.0, gt=0, description="sim runs this many times faster than its cost model"
    )
    vocab_size: Integer = Field(
        default=1024, ge=32, description="token ids are synthesized in [16, vocab_size)"
    )

    policy: str = Field(
        default="async", description="sync|async, plus +timeout, +hedge and/or +overlap"
    )
    tool_timeout_s: Number = Field(default=1.0, gt=0)
    overlap_ratio: Number = Field(
        default=0.25,
        gt=0,
        le=MAX_OVERLAP_RATIO,
        description="overlap launches N * (1 + ratio), 101 N at most",
    )  # 1e308 overflowed the launch count: an OverflowError traceback
    overlap_unfinished: Literal["carry", "abort"] = "carry"
    batch: Integer = Field(default=64, ge=1, description="trajectories that complete a step (N)")
    steps: Integer = Field(default=1, ge=1)
    observation_tokens: Integer = Field(
        default=16, ge=0, description="tokens a timeout/error observation appends"
    )

    exact: bool = Field(default=False, description="send recorded tool latencies as delay_s")
    length_scale: Number = Field(default=1.0, gt=0)
    max_prompt: Integer | None = Field(default=None, ge=1)
    max_output: Integer | None = Field(default=None, ge=1)
    max_append: Integer | None = Field(default=None, ge=0)
    limit: Integer | None = Field(default=None, ge=1)
    sample: Number | None = Field(default=None, gt=0, le=1)
    seed: Integer = Field(
        default=0, ge=0, description="numpy seeds each tool call's draws from it: non-negative"
    )

    live_max_turns: Integer = Field(
        default=4, ge=1, description="live mode: turns per trajectory at most"
    )
    live_max_tokens: Integer = Field(
        default=256, ge=1, description="live mode: tokens per turn at most"
    )

    vllm_max_num_seqs: Integer = Field(default=64, ge=1)
    vllm_block_size: Integer = Field(default=32, ge=16, description="multiple of 32 on CPU")
    vllm_max_model_len: Integer = Field(default=8192, ge=64)
    out_dir: str = "rollout-out"

    @field_validator("gateway_url", "openai_urls")
    @classmethod
    def _http_urls(cls, value: str | list[str]) -> str | list[str]:
        """A URL without a scheme was reported as an unreachable gateway (exit 3), not bad input."""
        for url in [value] if isinstance(value, str) else value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"must be an http:// or https:// URL, got {url!r}")
        return value
