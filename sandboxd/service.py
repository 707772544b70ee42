"""`SandboxService`: settings + backend + admission, and the mapping between wire and backend.

The service is what the gateway mounts in-process (through `build_router`) and what
`toolenv sandboxd serve` runs alone. It validates requests against the configured bounds,
admits them, runs them on whichever backend the settings name, and never lets a backend failure
escape as anything but a `SandboxError` in the response body.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import os
from typing import Any

from toolenv_core.deadline import Deadline

from .admission import Admission, Overloaded
from .backend import SandboxBackend, SandboxUnavailable
from .languages import LANGUAGES, UnknownLanguage, get_language
from .models import ExecResult, ExecStatus, Limits, RunResult, RunSpec
from .process_backend import InvalidPath, ProcessBackend, safe_relative_path
from .settings import SandboxSettings
from .wire import (
    CaseResult,
    CommandRunResult,
    RunCodeRequest,
    RunCodeResponse,
    RunStatus,
    RunTestsRequest,
    RunTestsResponse,
    Verdict,
)

log = logging.getLogger("sandboxd")

__all__ = ["BadRequest", "Overloaded", "SandboxService", "make_backend"]


class BadRequest(ValueError):
    """A request the client must fix: `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def make_backend(settings: SandboxSettings) -> SandboxBackend:
    """The backend `settings.backend` names; the Docker one is imported only when asked for."""
    if settings.backend == "process":
        return ProcessBackend(settings)
    if settings.backend == "docker":
        try:
            from .docker_backend import DockerBackend  # type: ignore[attr-defined]
        except ImportError as exc:
            raise SandboxUnavailable(
                f"docker backend not available in this installation ({exc}); use --backend process"
            ) from exc
        return DockerBackend(settings)
    raise SandboxUnavailable(f"unknown sandbox backend {settings.backend!r}: use process or docker")


def _exec_to_wire(e: ExecResult | None) -> CommandRunResult | None:
    if e is None:
        return None
    return CommandRunResult(
        status=e.status.value,
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


def _outputs_equal(actual: str, expected: str, how: str) -> bool:
    if how == "exact":
        return actual == expected
    if how == "tokens":
        return actual.split() == expected.split()
    a = [line.rstrip() for line in actual.rstrip().splitlines()]
    b = [line.rstrip() for line in expected.rstrip().splitlines()]
    return a == b


_VERDICT_OF_STATUS = {
    ExecStatus.TIME_LIMIT: Verdict.TIME_LIMIT,
    ExecStatus.MEMORY_LIMIT: Verdict.MEMORY_LIMIT,
    ExecStatus.OUTPUT_LIMIT: Verdict.OUTPUT_LIMIT,
    ExecStatus.ERROR: Verdict.SANDBOX_ERROR,
}


class SandboxService:
    """Holds the settings, the backend and admission for the lifetime of an app."""

    def __init__(self, settings: SandboxSettings, backend: SandboxBackend | None = None) -> None:
        self.settings = settings
        self.backend = backend
        self.admission = Admission(
            capacity=settings.concurrency,
            queue_size=settings.queue_size,
            queue_timeout_s=settings.queue_timeout_s,
            retry_after_s=settings.retry_after_s,
        )
        self.started = False
        self.pod_name = f"{os.uname().nodename}-{os.getpid()}"

    async def start(self) -> None:
        if self.backend is None:
            self.backend = make_backend(self.settings)
        await self.backend.start()
        self.started = True

    async def close(self) -> None:
        self.started = False
        if self.backend is not None:
            await self.backend.close()

    # ------------------------------------------------------------------ validation

    def _timeout(self, value: float | None, default: float, field: str) -> float:
        if value is None:
            return default
        if not 0 < value <= self.settings.max_timeout_s:
            raise BadRequest(
                422, f"{field} must be > 0 and <= {self.settings.max_timeout_s} s, got {value}"
            )
        return float(value)

    def _limits(
        self,
        *,
        wall: float,
        memory_mb: int | None,
        cpu_limit: float | None,
        max_output_bytes: int | None,
    ) -> Limits:
        s = self.settings
        if memory_mb is None or memory_mb in (-1, 0):
            memory_mb = s.default_memory_mb
        elif not 0 < memory_mb <= s.max_memory_mb:
            raise BadRequest(
                422,
                f"memory_limit_MB must be -1 (default) or 1..{s.max_memory_mb}, got {memory_mb}",
            )
        cores = os.cpu_count() or 1
        if cpu_limit is not None and not 0 < cpu_limit <= cores:
            raise BadRequest(422, f"cpu_limit must be > 0 and <= {cores} cores, got {cpu_limit}")
        if max_output_bytes is not None and not 0 < max_output_bytes <= s.max_output_bytes:
            raise BadRequest(
                422, f"max_output_bytes must be 1..{s.max_output_bytes}, got {max_output_bytes}"
            )
        return Limits(
            wall_time_s=wall,
            memory_mb=memory_mb,
            cpu_limit=cpu_limit,
            max_output_bytes=max_output_bytes or s.default_output_bytes,
            max_processes=s.max_processes,
            max_open_files=s.max_open_files,
            max_file_size_mb=s.max_file_size_mb,
        )

    @staticmethod
    def _decode_files(files: dict[str, str | None]) -> dict[str, bytes]:
        out: dict[str, bytes] = {}
        for name, b64 in files.items():
            try:
                safe_relative_path(name)
            except InvalidPath as exc:
                raise BadRequest(422, str(exc)) from exc
            try:
                out[name] = base64.b64decode(b64 or "", validate=True)
            except (binascii.Error, ValueError) as exc:
                raise BadRequest(422, f"files[{name!r}] is not valid base64: {exc}") from exc
        return out

    def _check_language(self, language: str) -> None:
        try:
            get_language(language)
        except UnknownLanguage as exc:
            raise BadRequest(400, str(exc)) from exc

    def _spec(
        self,
        *,
        code: str,
        language: str,
        stdin: str,
        files: dict[str, bytes],
        fetch_files: list[str],
        compile_timeout: float | None,
        run_timeout: float | None,
        memory_mb: int | None,
        cpu_limit: float | None,
        max_output_bytes: int | None,
    ) -> RunSpec:
        s = self.settings
        self._check_language(language)
        for name in fetch_files:
            try:
                safe_relative_path(name)
            except InvalidPath as exc:
                raise BadRequest(422, str(exc)) from exc
        run_wall = self._timeout(run_timeout, s.default_run_timeout_s, "run_timeout")
        compile_wall = self._timeout(
            compile_timeout, s.default_compile_timeout_s, "compile_timeout"
        )
        run_limits = self._limits(
            wall=run_wall,
            memory_mb=memory_mb,
            cpu_limit=cpu_limit,
            max_output_bytes=max_output_bytes,
        )
        compile_limits = self._limits(
            wall=compile_wall,
            memory_mb=max(run_limits.memory_mb or 0, s.default_memory_mb),
            cpu_limit=None,
            max_output_bytes=max_output_bytes,
        )
        return RunSpec(
            language=get_language(language).name,
            code=code,
            stdin=stdin,
            files=files,
            fetch_files=fetch_files,
            compile_limits=compile_limits,
            run_limits=run_limits,
        )

    # ------------------------------------------------------------------ running

    def _require_started(self) -> SandboxBackend:
        if not self.started or self.backend is None:
            raise BadRequest(503, "the sandbox service is not started")
        return self.backend

    async def _run_admitted(self, spec: RunSpec, deadline: Deadline) -> RunResult:
        """Run under an admission slot; a backend failure becomes a result with a message."""
        backend = self._require_started()
        async with self.admission.slot(deadline):
            try:
                return await backend.run(spec, deadline)
            except asyncio.CancelledError:
                raise
            except SandboxUnavailable as exc:  # expected under load: no traceback in the log
                log.warning("sandbox unavailable: %s", exc)
                return RunResult(
                    message=f"sandbox unavailable: {exc}", backend=getattr(backend, "name", None)
                )
            except Exception as exc:  # never a 500: report it in the body
                log.exception("sandbox backend failed")
                return RunResult(
                    message=f"sandbox backend error: {type(exc).__name__}: {exc}",
                    backend=getattr(backend, "name", None),
                )

    async def _compile_once(
        self, spec: RunSpec, deadline: Deadline
    ) -> tuple[ExecResult, bytes | None] | None:
        """For run_tests: compile one time when the backend can (None: it cannot, or no need)."""
        backend = self._require_started()
        compile_fn = getattr(backend, "compile", None)
        if compile_fn is None or get_language(spec.language).compile_argv is None:
            return None
        async with self.admission.slot(deadline):
            try:
                return await compile_fn(spec, deadline)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("sandbox backend failed to compile")
                return (
                    ExecResult(status=ExecStatus.ERROR, message=f"sandbox backend error: {exc}"),
                    None,
                )

    async def run_code(self, req: RunCodeRequest, deadline: Deadline) -> RunCodeResponse:
        """SandboxFusion semantics: Success only if compile (if any) and run exited 0."""
        spec = self._spec(
            code=req.code,
            language=req.language,
            stdin=req.stdin or "",
            files=self._decode_files(req.files),
            fetch_files=req.fetch_files,
            compile_timeout=req.compile_timeout,
            run_timeout=req.run_timeout,
            memory_mb=req.memory_limit_MB,
            cpu_limit=req.cpu_limit,
            max_output_bytes=req.max_output_bytes,
        )
        result = await self._run_admitted(spec, deadline)
        return self._to_response(result)

    def _to_response(self, result: RunResult) -> RunCodeResponse:
        compile_wire = _exec_to_wire(result.compile)
        run_wire = _exec_to_wire(result.run)
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
                message = failing.message or failing.status.value
        return RunCodeResponse(
            status=status,
            message=message,
            compile_result=compile_wire,
            run_result=run_wire,
            executor_pod_name=result.sandbox_id or self.pod_name,
            files={k: base64.b64encode(v).decode() for k, v in result.files.items()},
        )

    async def run_tests(self, req: RunTestsRequest, deadline: Deadline) -> RunTestsResponse:
        """Run one program against every case, `concurrency` at a time within admission."""
        s = self.settings
        if len(req.cases) > s.max_tests_per_request:
            raise BadRequest(
                422, f"at most {s.max_tests_per_request} cases per request, got {len(req.cases)}"
            )
        files = self._decode_files(req.files)
        run_timeout = self._timeout(req.timeout, s.default_run_timeout_s, "timeout")
        case_timeouts = [
            self._timeout(c.timeout, run_timeout, f"cases[{i}].timeout")
            for i, c in enumerate(req.cases)
        ]
        specs = [
            self._spec(
                code=req.code,
                language=req.language,
                stdin=case.stdin,
                files=files,
                fetch_files=[],
                compile_timeout=req.compile_timeout,
                run_timeout=t,
                memory_mb=req.memory_limit_MB,
                cpu_limit=req.cpu_limit,
                max_output_bytes=req.max_output_bytes,
            )
            for case, t in zip(req.cases, case_timeouts, strict=True)
        ]
        results: list[CaseResult | None] = [None] * len(specs)
        compile_result: CommandRunResult | None = None
        prebuilt = await self._compile_once(specs[0], deadline)
        if prebuilt is not None:
            compiled, artifact = prebuilt
            compile_result = _exec_to_wire(compiled)
            if artifact is None:
                verdict = (
                    Verdict.SANDBOX_ERROR
                    if compiled.status == ExecStatus.ERROR
                    else Verdict.COMPILE_ERROR
                )
                cases = [CaseResult(index=i, verdict=verdict) for i in range(len(specs))]
                return RunTestsResponse(
                    verdict=verdict,
                    passed=0,
                    total=len(cases),
                    pass_fraction=0.0,
                    compile_result=compile_result,
                    cases=cases,
                    message=compiled.message or "compilation failed",
                    executor_pod_name=self.pod_name,
                )
            specs = [spec.model_copy(update={"prebuilt": artifact}) for spec in specs]
        stop = asyncio.Event()
        next_index = iter(range(len(specs)))
        workers = min(len(specs), req.concurrency or s.concurrency, s.concurrency)

        def verdict_of(i: int, r: RunResult) -> Verdict:
            nonlocal compile_result
            if r.compile is not None and compile_result is None:
                compile_result = _exec_to_wire(r.compile)
            if r.run is None:
                if r.compile is not None and r.compile.status != ExecStatus.ERROR:
                    return Verdict.COMPILE_ERROR
                return Verdict.SANDBOX_ERROR
            e = r.run
            if e.status in _VERDICT_OF_STATUS:
                return _VERDICT_OF_STATUS[e.status]
            if e.exit_code != 0:
                return Verdict.RUNTIME_ERROR
            expected = req.cases[i].expected_stdout
            if expected is not None and not _outputs_equal(e.stdout, expected, req.comparison):
                return Verdict.WRONG_ANSWER
            return Verdict.ACCEPTED

        async def worker() -> None:
            for i in next_index:
                if stop.is_set():
                    return
                r = await self._run_admitted(specs[i], deadline)
                v = verdict_of(i, r)
                results[i] = CaseResult(index=i, verdict=v, run_result=_exec_to_wire(r.run))
                if v != Verdict.ACCEPTED and (
                    req.stop_on_first_failure or v == Verdict.COMPILE_ERROR
                ):
                    stop.set()

        tasks = [asyncio.create_task(worker()) for _ in range(workers)]
        stopper = asyncio.create_task(stop.wait())
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(
                    pending | {stopper}, return_when=asyncio.FIRST_COMPLETED
                )
                pending.discard(stopper)
                for t in done:
                    if t is not stopper and t.exception() is not None:
                        raise t.exception()  # type: ignore[misc]
                if stop.is_set() and req.stop_on_first_failure:
                    for t in pending:
                        t.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
                    break
        finally:
            stopper.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        cases = [r or CaseResult(index=i, verdict=Verdict.SKIPPED) for i, r in enumerate(results)]
        passed = sum(c.verdict == Verdict.ACCEPTED for c in cases)
        first_failure = next((c.verdict for c in cases if c.verdict != Verdict.ACCEPTED), None)
        if first_failure == Verdict.SKIPPED:
            first_failure = next(
                c.verdict for c in cases if c.verdict not in (Verdict.ACCEPTED, Verdict.SKIPPED)
            )
        return RunTestsResponse(
            verdict=first_failure or Verdict.ACCEPTED,
            passed=passed,
            total=len(cases),
            pass_fraction=passed / len(cases),
            compile_result=compile_result,
            cases=cases,
            executor_pod_name=self.pod_name,
        )

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
            "admission": self.admission.status(),
            **{k: v for k, v in backend_status.items() if k != "backend"},
        }
