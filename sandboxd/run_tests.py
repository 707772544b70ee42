"""`/v1/run_tests`: one program against many cases, a verdict per case and the pass fraction.

The program is compiled once when the backend can (`SandboxBackend.compile`), then every case
runs `concurrency` at a time, each within admission like any `/run_code`, inside what the
backend lets the request's cases share (`SandboxBackend.case_batch`: for python on the fork
server, one runner that forks a fresh process per case).
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from toolenv_core.admission import Rejected
from toolenv_core.deadline import Deadline

from .models import ExecResult, ExecStatus, RunResult, RunSpec
from .requests import BadRequest, RequestBounds
from .wire import (
    CaseResult,
    CommandRunResult,
    RunTestsRequest,
    RunTestsResponse,
    Verdict,
    exec_to_wire,
)

_VERDICT_OF_STATUS = {
    ExecStatus.TIME_LIMIT: Verdict.TIME_LIMIT,
    ExecStatus.MEMORY_LIMIT: Verdict.MEMORY_LIMIT,
    ExecStatus.OUTPUT_LIMIT: Verdict.OUTPUT_LIMIT,
    ExecStatus.ERROR: Verdict.SANDBOX_ERROR,
}


class CaseRunner(Protocol):
    """What run_tests needs from the service: admitted runs and an admitted compile."""

    async def run_admitted(
        self, spec: RunSpec, deadline: Deadline, batch: Any = None, *, committed: bool = False
    ) -> RunResult: ...

    def case_batch(self, spec: RunSpec, deadline: Deadline) -> AbstractAsyncContextManager[Any]: ...

    async def compile_once(
        self, spec: RunSpec, deadline: Deadline
    ) -> tuple[ExecResult, bytes | None] | None: ...


def outputs_equal(actual: str, expected: str, how: str) -> bool:
    if how == "exact":
        return actual == expected
    if how == "tokens":
        return actual.split() == expected.split()
    a = [line.rstrip() for line in actual.rstrip().splitlines()]
    b = [line.rstrip() for line in expected.rstrip().splitlines()]
    return a == b


def _case_specs(bounds: RequestBounds, req: RunTestsRequest) -> list[RunSpec]:
    s = bounds.settings
    if len(req.cases) > s.max_tests_per_request:
        raise BadRequest(
            422, f"at most {s.max_tests_per_request} cases per request, got {len(req.cases)}"
        )
    files = bounds.decode_files(req.files)
    run_timeout = bounds.timeout(req.timeout, s.default_run_timeout_s, "timeout")
    case_timeouts = [
        bounds.timeout(c.timeout, run_timeout, f"cases[{i}].timeout")
        for i, c in enumerate(req.cases)
    ]
    return [
        bounds.spec(
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


class _Cases:
    """The state of one run_tests call while its cases run."""

    def __init__(self, req: RunTestsRequest, specs: list[RunSpec], output_budget: int) -> None:
        self.req = req
        self.specs = specs
        self.results: list[CaseResult | None] = [None] * len(specs)
        self.compile_result: CommandRunResult | None = None
        self.stop = asyncio.Event()
        self.output_budget = output_budget
        self.output_room = output_budget

    def keep_within_budget(self, wire: CommandRunResult | None) -> None:
        """Cut a judged case's output to what is left of the answer's budget: each case may
        print up to its cap, and 1,000 cases at 16 MiB were a 16 GB answer (3x in the
        service's memory: a 335 MB answer took its RSS from 0.26 to 1.25 GB)."""
        if wire is None:
            return
        for stream in ("stdout", "stderr"):
            text: str = getattr(wire, stream) or ""
            size = len(text) if text.isascii() else len(text.encode())  # no copy per case
            if size > self.output_room:
                cut = text.encode()[: self.output_room].decode(errors="ignore")
                setattr(wire, stream, cut)
                setattr(wire, f"{stream}_truncated", True)
                wire.truncated = True
                note = f"{stream} cut: the answer carries {self.output_budget} bytes of output"
                wire.message = f"{wire.message}; {note}" if wire.message else note
            self.output_room = max(self.output_room - size, 0)

    def verdict_of(self, i: int, r: RunResult) -> Verdict:
        if r.compile is not None and self.compile_result is None:
            self.compile_result = exec_to_wire(r.compile)
        if r.run is None:
            return _compile_verdict(r.compile)
        e = r.run
        if e.status in _VERDICT_OF_STATUS:
            return _VERDICT_OF_STATUS[e.status]
        if e.exit_code != 0:
            return Verdict.RUNTIME_ERROR
        expected = self.req.cases[i].expected_stdout
        if expected is not None and not outputs_equal(e.stdout, expected, self.req.comparison):
            return Verdict.WRONG_ANSWER
        return Verdict.ACCEPTED

    async def run_case(
        self, runner: CaseRunner, spec: RunSpec, deadline: Deadline, batch: Any
    ) -> RunResult:
        """A case is refused a slot (a full queue, or `queue_timeout_s`) only while the request
        has no verdict yet: later, a 429 threw away the verdicts of the cases that had run, and
        the caller ran them all again. Its deadline still bounds the wait."""
        try:
            return await runner.run_admitted(spec, deadline, batch, committed=self.has_verdicts)
        except Rejected:  # refused while no case had a verdict: has one come in meanwhile?
            if not self.has_verdicts:
                raise  # the caller's 429: nothing ran that a retry would repeat
            return await runner.run_admitted(spec, deadline, batch, committed=True)

    @property
    def has_verdicts(self) -> bool:
        return any(r is not None for r in self.results)

    async def run_all(
        self, runner: CaseRunner, deadline: Deadline, workers: int, batch: Any = None
    ) -> None:
        next_index = iter(range(len(self.specs)))

        async def worker() -> None:
            for i in next_index:
                if self.stop.is_set():
                    return
                r = await self.run_case(runner, self.specs[i], deadline, batch)
                v = self.verdict_of(i, r)
                wire = exec_to_wire(r.run)
                self.keep_within_budget(wire)
                self.results[i] = CaseResult(index=i, verdict=v, run_result=wire)
                if v != Verdict.ACCEPTED and (
                    self.req.stop_on_first_failure or v == Verdict.COMPILE_ERROR
                ):
                    self.stop.set()

        tasks = [asyncio.create_task(worker()) for _ in range(workers)]
        stopper = asyncio.create_task(self.stop.wait())
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(
                    pending | {stopper}, return_when=asyncio.FIRST_COMPLETED
                )
                pending.discard(stopper)
                for t in done:
                    error = None if t is stopper else t.exception()
                    if error is not None:
                        raise error
                if self.stop.is_set() and self.req.stop_on_first_failure:
                    for t in pending:
                        t.cancel()
                    await asyncio.gather(*pending, return_exceptions=True)
                    break
        finally:
            stopper.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def response(self, pod_name: str) -> RunTestsResponse:
        # A compile error is the program's, so every case's: the cases it kept from running are
        # not "skipped" (where each case compiles, they were, beside the ones whose compiles
        # had started), as when the program is compiled once for the request.
        compile_failed = any(r and r.verdict == Verdict.COMPILE_ERROR for r in self.results)
        not_run = Verdict.COMPILE_ERROR if compile_failed else Verdict.SKIPPED
        cases = [r or CaseResult(index=i, verdict=not_run) for i, r in enumerate(self.results)]
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
            compile_result=self.compile_result,
            cases=cases,
            message="compilation failed" if compile_failed else "",
            executor_pod_name=pod_name,
        )


def _compile_verdict(step: ExecResult | None) -> Verdict:
    """Every case's verdict when the compile gave no program. A compile a time limit ended (its
    compile_timeout, or the request's deadline: it never started, or was cut) is `time_limit`, as
    the gateway answers a call whose deadline ran out; it was `compile_error`, the program's
    fault, for a deadline that ran out while the call waited for a slot."""
    if step is None or step.status == ExecStatus.ERROR:
        return Verdict.SANDBOX_ERROR
    if step.status == ExecStatus.TIME_LIMIT:
        return Verdict.TIME_LIMIT
    return Verdict.COMPILE_ERROR


def _succeeded(step: ExecResult) -> bool:
    return step.status == ExecStatus.FINISHED and step.exit_code == 0


async def run_tests(
    runner: CaseRunner,
    bounds: RequestBounds,
    req: RunTestsRequest,
    deadline: Deadline,
    pod_name: str,
) -> RunTestsResponse:
    """Run one program against every case, `concurrency` at a time within admission."""
    specs = _case_specs(bounds, req)
    prebuilt = await runner.compile_once(specs[0], deadline)
    compile_result: CommandRunResult | None = None
    if prebuilt is not None and prebuilt[1] is None and _succeeded(prebuilt[0]):
        # compiled, but the binary is over what a compile brings back (`max_output_bytes`):
        # each case compiles it where it runs (it read compile_error, from a compile that
        # exited 0)
        prebuilt = None
    if prebuilt is not None:
        compiled, artifact = prebuilt
        compile_result = exec_to_wire(compiled)
        if artifact is None:
            verdict = _compile_verdict(compiled)
            return RunTestsResponse(
                verdict=verdict,
                passed=0,
                total=len(specs),
                pass_fraction=0.0,
                compile_result=compile_result,
                cases=[CaseResult(index=i, verdict=verdict) for i in range(len(specs))],
                message=compiled.compile_failure(),
                executor_pod_name=pod_name,
            )
        specs = [spec.model_copy(update={"prebuilt": artifact}) for spec in specs]
    s = bounds.settings
    state = _Cases(req, specs, s.max_run_tests_output_bytes)
    state.compile_result = compile_result
    workers = min(len(specs), req.concurrency or s.concurrency, s.concurrency)
    # one isolation boundary for the request where the backend has one (the python fork
    # server: one runner forking a fresh process per case); else every case on its own
    async with runner.case_batch(specs[0], deadline) as batch:
        await state.run_all(runner, deadline, workers, batch)
    return state.response(pod_name)
