"""The gateway's generic tool call, as the rollout client uses it.

`POST {gateway}/v1/tools/{tool}/call` with `{"arguments": {...}}` and the headers
`X-Toolenv-Deadline-Ms` (remaining budget; none for a call without a deadline), `X-Trajectory-Id`,
`X-Step`, `X-Turn` (names in `toolenv_core.headers`). A 200 carries `status` "ok" or "error"; a
timeout is the gateway's structured 504 (`status: "timeout"`, also when the tool itself stopped
at the shared deadline first); backpressure is retried after its `Retry-After` while the deadline
allows (and never past the client's own timeout, 600 s by default): the gateway's own 429, and a
tool's (a 200 `status: "error"` that carries the tool's `Retry-After`, as sandboxd at capacity
answers). Transport failures become `status="error"` results so a trajectory goes on; only an
unreachable gateway at start-up stops the run (`GatewayUnreachable`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from toolenv_core import headers as h
from toolenv_core.deadline import Deadline

CLIENT_TIMEOUT_S = 600.0
"""How long a call may take at most, backpressure waited out included, when it has no deadline."""


def backpressure_gave_up(by_deadline: bool, timeout_s: float = CLIENT_TIMEOUT_S) -> str:
    """Why a call stopped waiting out 429s: its deadline, or the client's own timeout."""
    if by_deadline:
        return "backpressure past the deadline"
    return f"backpressure past the client's {timeout_s:g} s timeout"


class GatewayUnreachable(RuntimeError):
    """Nothing answers at the gateway URL (reported as one line by the CLI)."""


@dataclass(slots=True)
class ToolOutcome:
    status: str  # "ok" | "error" | "timeout"
    elapsed_s: float
    result: Any = None
    error: str | None = None
    http_status: int | None = None
    retries_429: int = 0  # 429s met: each waited out and retried, but a last one past the deadline


class GatewayClient:
    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int = 1024,
        default_timeout_s: float = CLIENT_TIMEOUT_S,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._default_timeout_s = default_timeout_s
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(default_timeout_s, connect=10.0),
            limits=httpx.Limits(
                max_connections=max_connections, max_keepalive_connections=max_connections
            ),
        )

    async def check(self) -> None:
        """Fail fast, in one line, when the gateway does not answer."""
        try:
            response = await self._client.get("/healthz", timeout=5.0)
        except httpx.HTTPError as exc:
            raise GatewayUnreachable(
                f"gateway {self.base_url} is unreachable ({type(exc).__name__}: {exc or 'no answer'}); "
                "start it with `toolenv serve` or pass --gateway URL"
            ) from None
        if response.status_code != 200:
            raise GatewayUnreachable(
                f"gateway {self.base_url}/healthz answered {response.status_code}"
            )

    async def close(self) -> None:
        await self._client.aclose()

    async def call(
        self,
        tool: str,
        arguments: dict[str, Any],
        *,
        deadline: Deadline | None = None,
        trajectory_id: str = "",
        step: int = 0,
        turn: int = 0,
    ) -> ToolOutcome:
        started = time.monotonic()
        headers = {h.TRAJECTORY: trajectory_id, h.STEP: str(step), h.TURN: str(turn)}
        retries = 0
        # Backpressure is waited out until the deadline, and never longer than the client's own
        # timeout: without a deadline a tool that answers 429 forever would hold the call forever.
        patience = Deadline(started + self._default_timeout_s).earliest(deadline)
        while True:
            timeout = self._default_timeout_s
            if deadline is not None:
                if deadline.expired:
                    return ToolOutcome(
                        "timeout",
                        time.monotonic() - started,
                        error="deadline expired",
                        retries_429=retries,
                    )
                headers.update(deadline.headers())
                if deadline.bounded:  # the gateway answers 504 at the deadline; this is a backstop
                    timeout = deadline.remaining() + 1.0
            try:
                response = await self._client.post(
                    f"/v1/tools/{_segment(tool)}/call",
                    json={"arguments": arguments},
                    headers=headers,
                    timeout=timeout,
                )
            except httpx.TimeoutException:
                return ToolOutcome(
                    "timeout",
                    time.monotonic() - started,
                    error="no answer before the deadline",
                    retries_429=retries,
                )
            except httpx.HTTPError as exc:
                return ToolOutcome(
                    "error",
                    time.monotonic() - started,
                    error=f"{type(exc).__name__}: {exc}",
                    retries_429=retries,
                )
            elapsed = time.monotonic() - started
            body = _json_object(response)
            if response.status_code == 429 or _tools_backpressure(response, body):
                retries += 1
                wait = _retry_after(response)
                if wait >= patience.remaining():
                    return ToolOutcome(
                        "timeout",
                        time.monotonic() - started,
                        error=backpressure_gave_up(patience is deadline, self._default_timeout_s),
                        http_status=429,
                        retries_429=retries,
                    )
                await asyncio.sleep(wait)
                continue
            if response.status_code == 504 or body.get("status") == "timeout":
                return ToolOutcome(
                    "timeout",
                    elapsed,
                    error=body.get("error"),
                    http_status=response.status_code,
                    retries_429=retries,
                )
            if response.status_code != 200:
                detail = body.get("detail") or body.get("error") or response.text[:200]
                return ToolOutcome(
                    "error",
                    elapsed,
                    error=f"HTTP {response.status_code}: {detail}",
                    http_status=response.status_code,
                    retries_429=retries,
                )
            return ToolOutcome(
                "ok" if body.get("status") == "ok" else "error",
                elapsed,
                result=body.get("result"),
                error=_error_with_reason(body),
                http_status=200,
                retries_429=retries,
            )


def _error_with_reason(body: dict[str, Any]) -> str | None:
    """The gateway's error for a tool's failed answer, with the tool's own reason when it gave
    one (a 422's `detail`): "tool 'search' answered HTTP 422" alone did not say what to fix."""
    error = body.get("error")
    result = body.get("result")
    detail = result.get("detail") if isinstance(result, dict) else None
    if not error or not detail:
        return error
    if isinstance(detail, list):  # pydantic's [{"loc": ["body", field], "msg": ...}, ...]
        detail = "; ".join(
            f"{_field(d.get('loc'))}: {d.get('msg')}" if isinstance(d, dict) else str(d)
            for d in detail
        )
    return f"{error}: {str(detail)[:300]}"


def _field(loc: Any) -> str:
    """A 422's field: FastAPI's `loc` starts with "body", sandboxd's names the field alone."""
    parts = [str(p) for p in loc] if isinstance(loc, list) else []
    return ".".join(parts[1:] if parts[:1] == ["body"] else parts)


def _json_object(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _tools_backpressure(response: httpx.Response, body: dict[str, Any]) -> bool:
    """A tool's own 429 (or 503) reaches the generic call as its error answer with its
    `Retry-After` passed on: backpressure, as the gateway's own 429 is."""
    return (
        response.status_code == 200
        and body.get("status") == "error"
        and "retry-after" in response.headers
    )


def _retry_after(response: httpx.Response) -> float:
    try:
        return max(0.01, float(response.headers.get("Retry-After", "0.1")))
    except ValueError:
        return 0.1


def _segment(tool: str) -> str:
    """The tool name as one escaped path segment, dots too (httpx removes `.`/`..` segments): a
    live model writes it, and `search/../sandbox` called the sandbox, `../../../run_code?` the
    gateway's /run_code. The gateway answers such a name as an unknown tool."""
    return quote(tool, safe="").replace(".", "%2E")
