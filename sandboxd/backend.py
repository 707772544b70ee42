"""The one interface both sandbox backends implement."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from toolenv_core.deadline import Deadline

from .models import ExecResult, RunResult, RunSpec


class SandboxUnavailable(RuntimeError):
    """The backend cannot take work (not started, pool exhausted past its bound, engine gone)."""


class SandboxBackend(Protocol):
    name: str
    deadline_margin_s: float
    """How long before the call's deadline this backend answers a run the deadline cut (what
    `SandboxService.ended_by_deadline` allows for): 0 where the kill is at the deadline itself."""

    async def start(self) -> None:
        """Acquire what the backend needs (check bwrap; warm the container pool, reap leftovers)."""

    async def close(self) -> None:
        """Release everything: no process, container, mount or temp dir may remain."""

    async def run(self, spec: RunSpec, deadline: Deadline) -> RunResult:
        """Compile (if needed) and run `spec`; never outlive `deadline`: kill and reap at expiry."""

    async def compile(
        self, spec: RunSpec, deadline: Deadline
    ) -> tuple[ExecResult, bytes | None] | None:
        """Compile once for many runs: the result and the artifact (None when the compile failed,
        or succeeded with an artifact over `max_output_bytes`: each run then compiles).

        None: this backend compiles as part of every `run` (run_tests then just runs each case).
        """

    def case_batch(self, spec: RunSpec, deadline: Deadline) -> AbstractAsyncContextManager[Any]:
        """For run_tests: what the request's cases share while they run (None: nothing; each
        case then runs as `run` would). Closing it leaves nothing of the request behind."""

    async def run_case(self, batch: Any, spec: RunSpec, deadline: Deadline) -> RunResult:
        """One case inside `batch` (a value `case_batch` gave, never None)."""

    def status(self) -> dict[str, Any]:
        """Pool size, busy, refilling, and whatever else helps an operator."""
