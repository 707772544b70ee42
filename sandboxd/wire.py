"""The HTTP wire formats: SandboxFusion's `/run_code` (plus optional extras) and `/v1/run_tests`.

Field names follow SandboxFusion exactly so its clients (verl's SandboxFusionTool and others)
work unchanged; the extra request fields are optional and the extra response fields are
additions a SandboxFusion client ignores.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from toolenv_core.fields import Integer, Number

from .models import ExecResult, ExecStatus


def _utf8(value: str) -> str:
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            raise PydanticCustomError(
                "lone_surrogate",
                "has a lone surrogate {char} at index {index}: not valid Unicode (a JSON "
                "escape \\uD800-\\uDFFF must be half of a pair)",
                {"char": repr(value[exc.start])[1:-1], "index": exc.start},
            ) from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]
"""Text a program receives (its code, stdin, expected output): a JSON string may escape a lone
surrogate, which no file or pipe can hold (it was a SandboxError, UnicodeEncodeError)."""


class RunCodeRequest(BaseModel):
    """SandboxFusion `POST /run_code`. Unknown fields are ignored, as SandboxFusion does."""

    model_config = ConfigDict(extra="ignore")

    code: Text = Field(description="the complete program")
    language: str = Field(
        default="python", description="python, bash, c or cpp (see /v1/languages)"
    )
    compile_timeout: Number | None = Field(default=None, description="seconds (default 10)")
    run_timeout: Number | None = Field(default=None, description="seconds (default 10)")
    memory_limit_MB: Integer | None = Field(
        default=None, description="-1, 0 or absent: the default"
    )
    stdin: Text | None = None
    files: dict[str, str | None] = Field(
        default_factory=dict,
        description="path in the working dir -> base64 content (null: no file, as SandboxFusion)",
    )
    fetch_files: list[str] = Field(default_factory=list, description="paths to return, base64")
    # extras (not in SandboxFusion)
    cpu_limit: Number | None = Field(default=None, description="CPU cores the program may use")
    max_output_bytes: Integer | None = Field(
        default=None, description="cap per stream, then killed"
    )


class CommandRunResult(BaseModel):
    """SandboxFusion's per-step result, plus limits and accounting fields."""

    status: Literal["Finished", "Error", "TimeLimitExceeded"] = Field(
        description="SandboxFusion's: Finished (a memory or output limit's kill included), Error, "
        "TimeLimitExceeded"
    )
    execution_time: float | None = Field(default=None, description="wall seconds")
    return_code: int | None = Field(default=None, description="negative: killed by that signal")
    stdout: str | None = None
    stderr: str | None = None
    # extras
    signal: int | None = None
    cpu_time: float | None = Field(
        default=None, description="CPU seconds of the program and the children it waited for"
    )
    peak_memory_kb: int | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    truncated: bool = False
    limit: Literal["time", "memory", "output"] | None = Field(
        default=None, description="the limit that ended the step, if one did"
    )
    message: str = ""


class RunStatus(StrEnum):
    SUCCESS = "Success"
    FAILED = "Failed"
    SANDBOX_ERROR = "SandboxError"


class RunCodeResponse(BaseModel):
    status: RunStatus
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


class TestCase(BaseModel):
    """One case. Unknown fields are refused, not ignored: a misnamed expected output (`output`)
    would leave a case that any program exiting 0 passes, a reward for a wrong program."""

    model_config = ConfigDict(extra="forbid")

    stdin: Text = ""
    expected_stdout: Text | None = Field(default=None, description="absent: only the exit matters")
    timeout: Number | None = Field(default=None, description="seconds; default: the request's")

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: object) -> object:
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                names = ", ".join(repr(str(k)) for k in unknown)
                known = ", ".join(cls.model_fields)
                raise PydanticCustomError(  # its own words, not "Value error, ..."
                    "unknown_case_fields",
                    "unknown case field(s) {names}; a case has {known}",
                    {"names": names, "known": known},
                )
        return data


class RunTestsRequest(BaseModel):
    """One program against many cases (code rewards)."""

    model_config = ConfigDict(extra="ignore")

    code: Text
    language: str = "python"
    cases: list[TestCase] = Field(min_length=1)
    timeout: Number | None = Field(default=None, description="run timeout per case (default 10)")
    compile_timeout: Number | None = None
    memory_limit_MB: Integer | None = None
    cpu_limit: Number | None = None
    max_output_bytes: Integer | None = None
    # no null content (SandboxFusion's /run_code skips it): here it is refused, naming the file
    files: dict[str, str] = Field(default_factory=dict, description="path -> base64 content")
    stop_on_first_failure: bool = False
    concurrency: Integer | None = Field(default=None, ge=1, description="cases at once (capped)")
    comparison: Literal["lines", "tokens", "exact"] = Field(
        default="lines",
        description="lines: trailing whitespace per line and trailing blank lines ignored; "
        "tokens: whitespace-separated tokens; exact: byte for byte",
    )


class Verdict(StrEnum):
    ACCEPTED = "accepted"
    WRONG_ANSWER = "wrong_answer"
    TIME_LIMIT = "time_limit"
    RUNTIME_ERROR = "runtime_error"
    MEMORY_LIMIT = "memory_limit"
    OUTPUT_LIMIT = "output_limit"
    COMPILE_ERROR = "compile_error"
    SANDBOX_ERROR = "sandbox_error"
    SKIPPED = "skipped"


class CaseResult(BaseModel):
    index: int
    verdict: Verdict
    run_result: CommandRunResult | None = None


class RunTestsResponse(BaseModel):
    verdict: Verdict = Field(description="accepted if every case passed, else the first failure's")
    passed: int
    total: int
    pass_fraction: float
    compile_result: CommandRunResult | None = None
    cases: list[CaseResult]
    message: str = ""
    executor_pod_name: str | None = None


# A step a memory or output limit ended is SandboxFusion's `Finished` with its return code (what
# SandboxFusion says of a program its limit killed); `limit` names the limit. As statuses of their
# own they failed SandboxFusion's own client (its enum has three: a ValidationError, and five
# re-runs of the program under its retries).
_WIRE_STATUS = {
    ExecStatus.MEMORY_LIMIT: ("Finished", "memory"),
    ExecStatus.OUTPUT_LIMIT: ("Finished", "output"),
    ExecStatus.TIME_LIMIT: ("TimeLimitExceeded", "time"),
}


def exec_to_wire(e: ExecResult | None) -> CommandRunResult | None:
    """A backend's step result in SandboxFusion's shape."""
    if e is None:
        return None
    status, limit = _WIRE_STATUS.get(e.status, (e.status.value, None))
    return CommandRunResult(
        status=status,
        limit=limit,
        execution_time=e.wall_time_s,
        return_code=e.exit_code,
        stdout=e.stdout,
        stderr=e.stderr,
        signal=e.signal,
        cpu_time=e.cpu_time_s,
        peak_memory_kb=e.peak_memory_kb,
        stdout_truncated=e.stdout_truncated,
        stderr_truncated=e.stderr_truncated,
        truncated=e.truncated,
        message=e.message,
    )
