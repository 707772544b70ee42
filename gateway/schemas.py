"""Wire models of the gateway's own routes, and each tool kind's schema in OpenAI function format.

The generic call's answer is a contract the rollout client relies on:

- 200 `{"tool", "status": "ok" | "error", "result": <upstream JSON>, "error": null | str,
  "elapsed_s", "request_id"}`: the tool answered (status "error" when it answered an HTTP error;
  `result` then holds its error body, and the tool's own `Retry-After`, as on its 429, is
  passed on as a header). A reply that is not strict JSON (text, `NaN`) is `result` as a string.
- 504 `{"tool", "status": "timeout", "error", "elapsed_s", "deadline_ms", "request_id"}`: the
  deadline expired; the upstream work was cancelled.
- 429 / 503 / 502 `{"tool", "status": "rejected" | "unavailable" | "upstream_failed", "error",
  "elapsed_s", "request_id"}`: refused by backpressure (with Retry-After), no upstream reachable,
  or the upstream failed mid-request.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from toolenv_core.fields import Integer, Number

from .settings import ToolConfig


class ToolCallRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    arguments: dict[str, Any] = Field(
        description="forwarded as the body of the tool's native endpoint (sandbox: the /run_code "
        "body; search: the native search body; reward: the reward body)"
    )
    deadline_ms: Number | None = Field(
        default=None,
        ge=0,
        description="this call's deadline (else X-Toolenv-Deadline-Ms, else the tool default)",
    )


class ToolCallResponse(BaseModel):
    tool: str
    status: Literal["ok", "error"]
    result: Any = None
    error: str | None = None
    elapsed_s: float
    request_id: str


class ToolFailureResponse(BaseModel):
    tool: str
    status: Literal["timeout", "rejected", "unavailable", "upstream_failed"]
    error: str
    elapsed_s: float
    deadline_ms: float | None = None
    request_id: str


class RunCodeBody(BaseModel):
    """SandboxFusion `/run_code` (forwarded as is)."""

    model_config = ConfigDict(extra="allow")
    code: str
    language: str = "python"
    compile_timeout: Number | None = None
    run_timeout: Number | None = None
    memory_limit_MB: Integer | None = None
    stdin: str | None = None
    files: dict[str, str] | None = None
    fetch_files: list[str] | None = None


class RetrieveBody(BaseModel):
    """Search-R1 `/retrieve` (forwarded as is)."""

    model_config = ConfigDict(extra="allow")
    queries: list[str]
    topk: Integer | None = None
    return_scores: bool | None = None


class RunTestsBody(BaseModel):
    """sandboxd `/v1/run_tests` (forwarded as is)."""

    model_config = ConfigDict(extra="allow")


_FUNCTION_PARAMETERS: dict[str, dict[str, Any]] = {
    "sandbox": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "the complete program to run"},
            "language": {
                "type": "string",
                "description": 'programming language, e.g. "python", "cpp", "bash"',
                "default": "python",
            },
            "stdin": {"type": "string", "description": "standard input for the program"},
        },
        "required": ["code"],
    },
    "search": {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "what to search for"},
            "topk": {
                "type": "integer",
                "minimum": 1,
                "description": "number of documents",
                "default": 3,
            },
        },
        "required": ["query"],
    },
    "reward": {
        "type": "object",
        "properties": {
            "batch_size": {"type": "integer", "minimum": 1, "description": "responses to verify"},
            "response_lengths": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0},
                "description": "token length of each response",
            },
        },
    },
    "http": {"type": "object", "properties": {}, "additionalProperties": True},
}

_DESCRIPTIONS = {
    "sandbox": "Run a program in an isolated sandbox and return its exit status, stdout and stderr.",
    "search": "Search a document collection and return the most relevant passages.",
    "reward": "Verify a batch of responses (emulated reward latency: no code runs).",
    "http": "Call the tool.",
}


def openai_function(tool: ToolConfig) -> dict[str, Any]:
    """The tool as an OpenAI `tools[]` entry, ready to hand to a model."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description or _DESCRIPTIONS[tool.kind],
            "parameters": tool.parameters or _FUNCTION_PARAMETERS[tool.kind],
        },
    }
