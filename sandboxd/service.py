"""`SandboxService`: settings + backend + admission, and the mapping between wire and backend.

The service is what the gateway mounts in-process (the app of `sandboxd.app.create_app`) and what
`toolenv sandboxd serve` runs alone. It validates requests against the configured bounds,
admits them, runs them on whichever backend the settings name, and never lets a backend failure
escape as anything but a `SandboxError` in the response body.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import signal
from contextlib import AbstractAsyncContextManager
from typing import Any

from toolenv_core.admission import Admission, ExpiredInQueue, Rejected
from toolenv_core.deadline import Deadline, DeadlinePolicy

from .backend import SandboxBackend, SandboxUnavailable
from .languages import LANGUAGES, get_language
from .models import ExecResult, ExecStatus, RunResult, RunSpec
from .process import ProcessBackend
from .requests import BadRequest, RequestBounds
from .run_tests import run_tests
from .settings import SandboxSettings
from .wire import (
    RunCodeRequest,
    RunCodeResponse,
    RunStatus,
    RunTestsRequest,
    RunTestsResponse,
    exec_to_wire,
)

log = logging.getLogger("sandboxd")

__all__ = ["BadRequest", "Rejected", "SandboxService", "make_backend"]

DEADLINE_TIE_S = 0.05
"""A TimeLimitExceeded answered with less than this (plus the backend's own answer margin) of
the call's deadline left counts as the deadline's, not the program's own `run_timeout`: the two
limits were that close, and the deadline would have ended the run within that time anyway."""
_TIME_LIMIT = ExecStatus.TIME_LIMIT.value


def make_backend(settings: SandboxSettings) -> SandboxBackend:
    """The backend `settings.backend` names; the Docker one is imported only when asked for."""
    if settings.backend == "process":
        return ProcessBackend(settings)
    if settings.backend == "docker":
        try:
            from .docker_backend import DockerBackend
        except ImportError as exc:
            raise SandboxUnavailable(
                f"docker backend not available in this installation ({exc}); use --backend process"
            ) from exc
        return DockerBackend(settings)
    raise SandboxUnavailable(f"unknown sandbox backend {settings.backend!r}: use process or docker")


def _how_it_ended(e: ExecResult) -> str:
    """A failed step's end in words, when no limit explains it ("Finished" said nothing)."""
    if e.status != ExecStatus.FINISHED:
        return e.status.value
    if e.signal is not None:
        try:
            return f"killed by signal {e.signal} ({signal.Signals(e.signal).name})"
        except ValueError:  # a real-time signal has no name
            return f"killed by signal {e.signal}"
    return f"exited with code {e.exit_code}"


class SandboxService:
    """Holds the settings, the backend and admission for the lifetime of an app."""

    def __init__(self, settings: SandboxSettings, backend: SandboxBackend | None = None) -> None:
        self.settings = settings
        self.backend = backend
        self.admission = Admission(
            "sandbox",
            settings.concurrency,
            settings.queue_size,
            queue_timeout_s=settings.queue_timeout_s,
            retry_after_s=settings.retry_after_s,
        )
        self.bounds = RequestBounds(settings)
        self.deadlines = DeadlinePolicy(settings.default_deadline_s, settings.max_deadline_s)
        self.started = False
        self.pod_name = f"{os.uname().nodename}-{os.getpid()}"

    async def start(self) -> None:
        if self.backend is None:
            self.backend = make_backend(self.settings)
        await self.backend.start()
        self.started = True
        if self.settings.insecure_no_isolation and self.settings.backend == "process":
            # said once, loudly: only /v1/sandbox/status told it, and programs run as root here
            log.warning(
                "insecure_no_isolation: programs run without bubblewrap, as this service's user "
                "(uid %d), with its file system and network: trusted code only",
                os.getuid(),
            )

    async def close(self) -> None:
        self.started = False
        if self.backend is not None:
            await self.backend.close()

    # ------------------------------------------------------------------ running

    def _require_started(self) -> SandboxBackend:
        if not self.started or self.backend is None:
            raise BadRequest(503, "the sandbox service is not started")
        return self.backend

    def case_batch(self, spec: RunSpec, deadline: Deadline) -> AbstractAsyncContextManager[Any]:
        """For run_tests: what the request's cases share (see `SandboxBackend.case_batch`)."""
        return self._require_started().case_batch(spec, deadline)

    async def run_admitted(
        self, spec: RunSpec, deadline: Deadline, batch: Any = None, *, committed: bool = False
    ) -> RunResult:
        """Run under an admission slot (`committed`: see `Admission.acquire`); a backend failure
        becomes a result with a message, and a deadline that ran out waiting (for a slot, for a
        Docker container) a TimeLimitExceeded one, as a deadline that ends the run does."""
        backend = self._require_started()
        try:
            async with self.admission.slot(deadline, committed=committed):
                return await self._run_on(backend, spec, deadline, batch)
        except ExpiredInQueue as exc:
            return RunResult(
                run=ExecResult.expired_before_start(str(exc)),
                message=str(exc),
                backend=backend.name,
            )

    async def _run_on(
        self, backend: SandboxBackend, spec: RunSpec, deadline: Deadline, batch: Any
    ) -> RunResult:
        try:
            if batch is not None:
                return await backend.run_case(batch, spec, deadline)
            return await backend.run(spec, deadline)
        except (asyncio.CancelledError, ExpiredInQueue):
            raise
        except SandboxUnavailable as exc:  # expected under load: no traceback in the log
            log.warning("sandbox unavailable: %s", exc)
            return RunResult(message=f"sandbox unavailable: {exc}", backend=backend.name)
        except Exception as exc:  # never a 500: report it in the body
            log.exception("sandbox backend failed")
            return RunResult(
                message=f"sandbox backend error: {type(exc).__name__}: {exc}",
                backend=backend.name,
            )

    async def compile_once(
        self, spec: RunSpec, deadline: Deadline
    ) -> tuple[ExecResult, bytes | None] | None:
        """For run_tests: compile one time when the backend can (None: it cannot, or no need)."""
        backend = self._require_started()
        if get_language(spec.language).compile_argv is None:
            return None
        try:
            async with self.admission.slot(deadline):
                return await backend.compile(spec, deadline)
        except (asyncio.CancelledError, Rejected):
            raise  # a full queue is the caller's 429, as for a run
        except ExpiredInQueue as exc:
            return ExecResult.expired_before_start(str(exc)), None
        except Exception as exc:
            log.exception("sandbox backend failed to compile")
            return (
                ExecResult(status=ExecStatus.ERROR, message=f"sandbox backend error: {exc}"),
                None,
            )

    async def run_code(self, req: RunCodeRequest, deadline: Deadline) -> RunCodeResponse:
        """SandboxFusion semantics: Success only if compile (if any) and run exited 0."""
        spec = self.bounds.spec(
            code=req.code,
            language=req.language,
            stdin=req.stdin or "",
            files=self.bounds.decode_files(req.files),
            fetch_files=req.fetch_files,
            compile_timeout=req.compile_timeout,
            run_timeout=req.run_timeout,
            memory_mb=req.memory_limit_MB,
            cpu_limit=req.cpu_limit,
            max_output_bytes=req.max_output_bytes,
        )
        result = await self.run_admitted(spec, deadline)
        return self._to_response(result)

    def _to_response(self, result: RunResult) -> RunCodeResponse:
        compile_wire = exec_to_wire(result.compile)
        run_wire = exec_to_wire(result.run)
        steps = [e for e in (result.compile, result.run) if e is not None]
        if not steps or any(e.status == ExecStatus.ERROR for e in steps):
            status = RunStatus.SANDBOX_ERROR
        elif all(e.status == ExecStatus.FINISHED and e.exit_code == 0 for e in steps) and (
            result.run is not None
        ):
            status = RunStatus.SUCCESS
        else:
            status = RunStatus.FAILED
        message = result.message
        if not message and status != RunStatus.SUCCESS:
            failing = next(
                (e for e in steps if e.status != ExecStatus.FINISHED or e.exit_code), None
            )
            if failing is not None:
                message = failing.message or _how_it_ended(failing)
        return RunCodeResponse(
            status=status,
            message=message,
            compile_result=compile_wire,
            run_result=run_wire,
            executor_pod_name=result.sandbox_id or self.pod_name,
            files={k: base64.b64encode(v).decode() for k, v in result.files.items()},
        )

    async def run_tests(self, req: RunTestsRequest, deadline: Deadline) -> RunTestsResponse:
        """One program against every case (see `sandboxd.run_tests`)."""
        return await run_tests(self, self.bounds, req, deadline, self.pod_name)

    def ended_by_deadline(
        self, answer: RunCodeResponse | RunTestsResponse, deadline: Deadline
    ) -> bool:
        """Whether the call's deadline (the one sent, capped by `max_deadline_s`) ended this
        answer: a step (compile, run, a case) ended TimeLimitExceeded and the deadline had run
        out by the time the answer was built. A step's wall limit is the smaller of its own
        timeout and what is left of the deadline, so a program's own `run_timeout` ends it with
        time to spare: that TimeLimitExceeded is the one the caller asked for, not a deadline's.
        Within `DEADLINE_TIE_S` of each other the deadline's is chosen (see above)."""
        margin = DEADLINE_TIE_S + (self.backend.deadline_margin_s if self.backend else 0.0)
        if not deadline.bounded or deadline.remaining() > margin:
            return False  # every answer asks this: the cheap test first, then the steps
        if isinstance(answer, RunCodeResponse):
            steps = [answer.compile_result, answer.run_result]
        else:
            steps = [answer.compile_result, *(case.run_result for case in answer.cases)]
        return any(step is not None and step.status == _TIME_LIMIT for step in steps)

    # ------------------------------------------------------------------ introspection

    def languages(self) -> list[dict[str, Any]]:
        return [
            {
                "name": lang.name,
                "aliases": list(lang.aliases),
                "compiled": lang.compiled,
                "source_file": lang.source_file,
            }
            for lang in LANGUAGES.values()
        ]

    def _admission_why(self) -> dict[str, str | None]:
        """The limit's origin, and why a call would wait now (None: it would not)."""
        a = self.admission
        waits = None
        if a.in_flight >= a.limit or a.waiting:
            waits = (
                f"all {a.limit} program slots are in flight; {a.waiting} calls queued ahead "
                "of a new one, each starts when a running program ends"
            )
        return {"limit_from": self.settings.admission_reason(), "waits_because": waits}

    def status(self) -> dict[str, Any]:
        backend_status: dict[str, Any] = {}
        if self.backend is not None:
            try:
                backend_status = self.backend.status()
            except Exception as exc:
                backend_status = {"error": f"{type(exc).__name__}: {exc}"}
        return {
            "backend": self.settings.backend,
            "started": self.started,
            "admission": {**self.admission.status(), **self._admission_why()},
            **{k: v for k, v in backend_status.items() if k != "backend"},
        }
