"""What a sandbox backend is asked to run and what it reports (wire-format agnostic).

The HTTP layer maps SandboxFusion's `/run_code` onto `RunSpec` and `RunResult` back onto the
wire; backends never see HTTP. Limits are plain numbers so both backends enforce the same thing.
"""

from __future__ import annotations

import codecs
from enum import StrEnum

from pydantic import BaseModel, Field


class ExecStatus(StrEnum):
    """How one step (compile or run) ended."""

    FINISHED = "Finished"  # exited by itself (any exit code)
    ERROR = "Error"  # could not be started, or the sandbox failed around it
    TIME_LIMIT = "TimeLimitExceeded"
    MEMORY_LIMIT = "MemoryLimitExceeded"
    OUTPUT_LIMIT = "OutputLimitExceeded"


def decode_output(data: bytes, truncated: bool) -> str:
    """A stream's bytes as text (invalid UTF-8 replaced). Output cut at its cap drops the
    character the cut split: it ended in U+FFFD, which made the text longer than the cap."""
    if not truncated:
        return data.decode(errors="replace")
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=False)


def output_limit_message(stream: str, cap: int, signal: int | None) -> str:
    """Why a step whose `stream` passed `cap` bytes ended. It is killed at once, unless it had
    exited by itself before that output was read (no signal: it said "the program was killed"
    beside a return_code of 0)."""
    end = "the program was killed" if signal is not None else "it had already exited by itself"
    return f"{stream} exceeded {cap} bytes; {end}"


class Limits(BaseModel):
    """Hard limits for one step. None means the backend's configured default."""

    wall_time_s: float = Field(default=10.0, gt=0)
    cpu_time_s: float | None = Field(default=None, gt=0)
    memory_mb: int | None = Field(default=None, gt=0)
    max_processes: int | None = Field(default=None, gt=0)
    max_open_files: int | None = Field(default=None, gt=0)
    max_file_size_mb: int | None = Field(default=None, gt=0)
    max_output_bytes: int | None = Field(default=None, gt=0)
    cpu_limit: float | None = Field(default=None, gt=0, description="CPU cores (docker backend)")


class RunSpec(BaseModel):
    """One program: source, inputs, and the limits of its compile and run steps."""

    language: str
    code: str
    stdin: str = ""
    files: dict[str, bytes] = Field(
        default_factory=dict, description="workdir-relative path -> content"
    )
    fetch_files: list[str] = Field(default_factory=list)
    compile_limits: Limits = Field(default_factory=Limits)
    run_limits: Limits = Field(default_factory=Limits)
    prebuilt: bytes | None = Field(
        default=None,
        description="the compile step's artifact from an earlier `compile`: the compile step "
        "is skipped",
    )


class ExecResult(BaseModel):
    status: ExecStatus
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_time_s: float = 0.0
    cpu_time_s: float | None = None
    peak_memory_kb: int | None = None
    message: str = ""  # why the step ended this way (which limit, what failed), for people

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated

    def compile_failure(self) -> str:
        """Why a compile gave no program, for the answer's `message`: the words of the limit that
        ended it (its compile_timeout, the request's deadline, memory, an output cap), else
        "compilation failed" (the compiler's own error). A time limit read "compilation failed"
        on /run_code, for a program a 150 ms deadline cut while g++ was still at work."""
        return self.message or "compilation failed"

    @classmethod
    def expired_before_start(
        cls, message: str = "the request deadline expired before start"
    ) -> ExecResult:
        """A step the call's deadline ended before it began (nothing ran): TimeLimitExceeded, as
        a deadline that ends a running step, so `ended_by_deadline` marks the answer."""
        return cls(status=ExecStatus.TIME_LIMIT, message=message)


class RunResult(BaseModel):
    compile: ExecResult | None = None  # None for interpreted languages
    run: ExecResult | None = None  # None when compilation failed
    files: dict[str, bytes] = Field(default_factory=dict)
    sandbox_id: str | None = None  # container name or process-sandbox id
    message: str = ""
    backend: str | None = None  # which backend ran it ("process", "docker")
