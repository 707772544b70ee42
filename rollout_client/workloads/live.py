"""Live rollouts: the model's own text decides the tool calls, and real tools answer.

Tool-call format (what the parser looks for in a turn's decoded text, first match wins):

1. `<tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call>` (Hermes/Qwen
   style); `name` is any gateway tool, `arguments` its native body;
2. a fenced code block, `` ```python `` (or `py`, `bash`, `sh`, `cpp`, `c`) ... `` ``` ``, run in
   the `sandbox` tool as `{"code": ..., "language": ...}`.

A turn without a tool call ends the trajectory. The tool's answer is appended to the context as
`<tool_response>{json}</tool_response>` tokenized with the model's tokenizer; a timeout or error
becomes `<tool_response>{"status": "timeout"|"error", "error": ...}</tool_response>`. A
`<tool_call>` whose JSON does not parse gets an error observation, so the model can retry.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .plan import ToolCallPlan, TrajectoryPlan, TurnPlan

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
FENCE = re.compile(r"```(python|py|bash|sh|cpp|c)\s*\n(.*?)```", re.S)
_LANG = {"py": "python", "sh": "bash"}


@dataclass(frozen=True, slots=True)
class ParsedCall:
    tool: str
    arguments: dict[str, Any]
    error: str | None = None  # the call was malformed; answer with this error observation


def parse_tool_call(text: str) -> ParsedCall | None:
    """The first tool call in a turn's text, or None when the turn calls no tool."""
    tagged = TOOL_CALL.search(text)
    fenced = FENCE.search(text)
    if tagged and (not fenced or tagged.start() < fenced.start()):
        try:
            body = json.loads(tagged.group(1))
        except json.JSONDecodeError as exc:
            return ParsedCall("", {}, error=f"tool_call is not valid JSON: {exc.msg}")
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return ParsedCall("", {}, error='tool_call needs {"name": str, "arguments": {...}}')
        arguments = body.get("arguments", {})
        if isinstance(arguments, str):  # some models emit the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return ParsedCall(body["name"], {}, error="arguments is a string that is not JSON")
        if not isinstance(arguments, dict):
            return ParsedCall(body["name"], {}, error="arguments must be an object")
        return ParsedCall(body["name"], arguments)
    if fenced:
        language = _LANG.get(fenced.group(1), fenced.group(1))
        return ParsedCall("sandbox", {"code": fenced.group(2), "language": language})
    return None


def render_observation(status: str, result: Any = None, error: str | None = None) -> str:
    body: Any = result if status == "ok" else {"status": status, "error": error}
    return f"<tool_response>{json.dumps(body, ensure_ascii=False)}</tool_response>"


class LiveDriver:
    """What the runner asks a live trajectory after each turn: decode, parse, render answers."""

    def __init__(
        self,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        max_turns: int = 4,
        max_tokens: int = 256,
    ) -> None:
        self.encode, self.decode = encode, decode
        self.max_turns, self.max_tokens = max_turns, max_tokens

    def after_turn(
        self, plan: TrajectoryPlan, turn: int, output_ids: list[int], engine_reason: str | None
    ) -> None:
        """Set the turn's calls from its text and add the next turn if the model called a tool.
        A turn without a call ends as the engine said: "length" when `max_tokens` cut it (it was
        recorded "stop", as if the model had finished), else "stop"."""
        parsed = parse_tool_call(self.decode(output_ids))
        current = plan.turns[turn]
        if parsed is None:
            current.finish_reason = "length" if engine_reason == "length" else "stop"
            return
        current.finish_reason = "tool_calls"
        call = ToolCallPlan(
            parsed.tool or "invalid",
            parsed.arguments,
            append_tokens=0,
            query_count=1,
            live_error=parsed.error,
        )
        current.calls = [call]
        if turn + 1 < self.max_turns:
            plan.turns.append(TurnPlan(self.max_tokens, forced=False))

    def observation_ids(
        self, status: str, result: Any = None, error: str | None = None
    ) -> list[int]:
        return self.encode(render_observation(status, result, error))


def load_prompts(path: str | Path) -> Iterator[dict[str, Any]]:
    """JSONL of `{"id"?, "prompt": str}` or `{"id"?, "messages": [...]}`.

    Every problem is a ValueError naming the file (and line): a missing file or a directory was
    a traceback, a non-UTF-8 byte a bare codec message."""
    try:
        f = Path(path).open("rb")  # decoded line by line, so that a bad byte names its line
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the --live prompts: {exc.strerror or exc}") from exc
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not UTF-8 text ({exc.reason})") from exc
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(row, dict) or not ("prompt" in row or "messages" in row):
                raise ValueError(f"{path}:{lineno}: field 'prompt' or 'messages' is required")
            yield row


def live_plans(
    rows: Iterable[dict[str, Any]], tokenizer: Any, *, max_turns: int = 4, max_tokens: int = 256
) -> tuple[list[TrajectoryPlan], LiveDriver]:
    """Plans whose first turn is free-running and whose prompts are the tokenized chat prompts."""
    driver = LiveDriver(
        lambda text: tokenizer.encode(text, add_special_tokens=False),
        lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        max_turns=max_turns,
        max_tokens=max_tokens,
    )
    plans = []
    for i, row in enumerate(rows):
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # a BatchEncoding in recent transformers
            ids = ids["input_ids"]
        plan = TrajectoryPlan(
            str(row.get("id", f"live-{i}")),
            len(ids),
            [TurnPlan(max_tokens, forced=False)],
            prompt_ids=list(ids),
        )
        plans.append(plan)
    return plans, driver
