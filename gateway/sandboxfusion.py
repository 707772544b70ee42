"""SandboxFusion's deadline semantics on the sandbox pass-through routes (`/run_code`,
`/v1/run_tests`), so a SandboxFusion client pointed at the gateway sees what SandboxFusion does.

- **No deadline header**: the request bounds itself, as in SandboxFusion. The budget is its own
  `compile_timeout` plus `run_timeout` (for `/v1/run_tests`, the run timeout of every case in
  turn), where absent the tool's `default_compile_timeout_s` / `default_run_timeout_s` (what the
  sandbox applies: SandboxFusion's 10 s unless configured), plus the tool's `timeout_margin_ms`
  for queueing and start-up; capped by the tool's `max_deadline_ms` like any budget. A
  `run_timeout: 40` run is never cut by a fixed default below what sandboxd accepts.
- **The caller's deadline expires first**: the answer keeps the route's shape. sandboxd is told a
  deadline `reserve_s` early, so it stops the program and answers `TimeLimitExceeded` with the
  output so far; should the gateway's own timer still fire first (the call never left the queue,
  or the sandbox did not answer), the gateway says the same in the same shape, without output.

The generic call (`/v1/tools/{tool}/call`) keeps its documented structured 504.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import TypeAdapter, ValidationError

from toolenv_core.fields import Number

from .dispatch import Outcome
from .settings import ToolConfig

SANDBOX_ROUTES = frozenset({"/run_code", "/v1/run_tests"})
_NUMBER: TypeAdapter[float] = TypeAdapter(Number)  # a number field as sandboxd's models read it


def _seconds(value: Any, default: float) -> float | None:
    """A timeout field read as sandboxd reads it (ints, floats and numeric strings such as `"40"`,
    as in SandboxFusion; never a boolean); None when that is not a positive finite number:
    sandboxd will say why."""
    if value is None:
        return default
    if type(value) is not int and type(value) is not float:
        try:
            value = _NUMBER.validate_python(value)
        except ValidationError:
            return None
    try:
        seconds = float(value)
    except OverflowError:  # an integer past the float range, e.g. 10**400
        return None
    return seconds if math.isfinite(seconds) and seconds > 0 else None


def request_budget_ms(path: str, body: Any, tool: ToolConfig) -> float | None:
    """The budget a request gives itself (see the module doc); None when it cannot be read."""
    if not isinstance(body, dict):
        return None
    compile_s = _seconds(body.get("compile_timeout"), tool.default_compile_timeout_s)
    if path == "/run_code":
        run_s = _seconds(body.get("run_timeout"), tool.default_run_timeout_s)
    else:
        cases = body.get("cases")
        per_case = _seconds(body.get("timeout"), tool.default_run_timeout_s)
        if not isinstance(cases, list) or not cases or per_case is None:
            return None
        times = [
            _seconds(c.get("timeout") if isinstance(c, dict) else None, per_case) for c in cases
        ]
        run_s = None if None in times else sum(t for t in times if t is not None)
    if compile_s is None or run_s is None:
        return None
    return (compile_s + run_s) * 1000.0 + tool.timeout_margin_ms


def reserve_s(budget_ms: float) -> float:
    """How much earlier than the caller's deadline sandboxd is told to stop: time for it to kill
    the program and answer with its output before the gateway's own timer."""
    return min(0.25, 0.1 * budget_ms / 1000.0)


# Whose deadline a pass-through call had (`timeout_answer`): one without a deadline header was
# said to have run out "the caller's deadline", which it never sent
CALLERS, OWN, DEFAULT = (
    "the caller's deadline ({ms} ms)",
    "the request's own bound ({ms} ms: its compile_timeout + run_timeout + the tool's "
    "timeout_margin_ms)",
    "the tool's default deadline ({ms} ms, its default_deadline_ms)",
)


def timeout_answer(path: str, body: Any, outcome: Outcome, whose: str = CALLERS) -> dict[str, Any]:
    """The route's own answer for a call whose deadline expired in the gateway (HTTP 200)."""
    said = whose.format(ms=f"{outcome.deadline_ms:.15g}")
    message = f"{said} expired at the gateway: {outcome.error}"
    if path == "/run_code":
        return {
            "status": "Failed",
            "message": message,
            "compile_result": None,
            "run_result": {
                "status": "TimeLimitExceeded",
                "execution_time": round(outcome.elapsed_s, 6),
                "return_code": None,
                "stdout": "",
                "stderr": "",
                "limit": "time",  # the limit that ended it, as sandboxd's answers say
            },
            "executor_pod_name": None,
            "files": {},
        }
    cases = body.get("cases") if isinstance(body, dict) else None
    total = len(cases) if isinstance(cases, list) else 0
    return {
        "verdict": "time_limit",
        "passed": 0,
        "total": total,
        "pass_fraction": 0.0,
        "compile_result": None,
        "cases": [{"index": i, "verdict": "time_limit", "run_result": None} for i in range(total)],
        "message": message,
        "executor_pod_name": None,
    }
