"""Sandbox service settings (section `sandbox`, env prefix `TOOLENV_SANDBOX_`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from toolenv.config import ServiceSettings


class SandboxSettings(ServiceSettings):
    model_config = SettingsConfigDict(
        env_prefix="TOOLENV_SANDBOX_", extra="ignore", env_nested_delimiter="__"
    )
    section: ClassVar[str] = "sandbox"

    backend: Literal["process", "docker"] = "process"

    # ---- serving
    host: str = "127.0.0.1"
    port: int = Field(default=8081, ge=0, le=65535)

    # ---- admission: how many programs run at once, how many wait, how long they may wait
    max_concurrency: int = Field(default=4, ge=1, description="programs running at once")
    queue_size: int = Field(default=256, ge=0, description="requests waiting beyond that; then 429")
    queue_timeout_s: float = Field(
        default=30.0, gt=0, description="longest wait for a slot before 429"
    )
    retry_after_s: int = Field(default=1, ge=0, description="Retry-After sent with a 429")
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024, description="else 413")

    # ---- limits (per step); requests may ask for less, never more than the max_* values
    default_compile_timeout_s: float = Field(default=10.0, gt=0)
    default_run_timeout_s: float = Field(default=10.0, gt=0)
    max_timeout_s: float = Field(default=60.0, gt=0, description="larger timeouts are a 422")
    default_memory_mb: int = Field(default=512, ge=16)
    max_memory_mb: int = Field(default=4096, ge=16)
    max_processes: int = Field(default=64, ge=4, description="pids cgroup limit per run")
    max_open_files: int = Field(default=256, ge=16)
    max_file_size_mb: int = Field(default=64, ge=1, description="RLIMIT_FSIZE per file")
    default_output_bytes: int = Field(default=1024 * 1024, ge=1024, description="stdout/stderr cap")
    max_output_bytes: int = Field(default=16 * 1024 * 1024, ge=1024)
    max_tests_per_request: int = Field(default=1000, ge=1)

    # ---- process backend
    bwrap_path: str | None = Field(default=None, description="default: `bwrap` on PATH")
    insecure_no_isolation: bool = Field(
        default=False, description="run programs without bubblewrap (only for trusted code)"
    )
    workdir_root: str | None = Field(
        default=None, description="where run dirs live; default /dev/shm (tmpfs) else the tmp dir"
    )
    cgroup_pool_size: int = Field(default=0, ge=0, description="0: max_concurrency * 2")
