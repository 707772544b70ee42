"""The `docker` backend: runs go to warm containers whose agent resets them after every run.

One run = one request over the container's agent socket (no `docker exec`, no container start):
the agent writes the files, compiles and runs as an unprivileged uid with rlimits, answers, then
kills everything but itself, wipes the writable places and verifies the clean state. The
container goes back to the pool only after that verified reset; any anomaly (unclean reset, a
cgroup OOM kill, an agent that does not answer in time or drops the connection) destroys it and
a replacement starts in the background.

`/v1/run_tests` compiles a C/C++ program once, in one container, whose agent sends the binary
back; each case then runs it in a container of its own, reset after the case before.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import math
import posixpath
import signal
from contextlib import AbstractAsyncContextManager
from typing import Any

import docker
import docker.errors

from toolenv_core.deadline import Deadline

from ..backend import SandboxUnavailable
from ..languages import CHILD_ENV, Language, UnknownLanguage, get_language
from ..models import (
    ExecResult,
    ExecStatus,
    Limits,
    RunResult,
    RunSpec,
    decode_output,
    output_limit_message,
)
from ..settings import SandboxSettings
from .agent_client import AgentError
from .container import SandboxContainer
from .image import ensure_image
from .pool import ContainerPool

# The agent answers this much before the host's deadline, so the answer (with partial output)
# still arrives in time; the host kills the container when even that does not come.
ANSWER_MARGIN_S = 0.15
NO_DEADLINE_SLACK_S = 30.0
AGENT_GRACE_S = 5.0
"""How long past a job's budget the host still waits for its agent's answer."""
MEMORY_ERROR_MARKERS = ("MemoryError", "std::bad_alloc", "Cannot allocate memory", "out of memory")


class _AgentLost(Exception):
    """The agent's connection broke before it answered; carries the error result to report."""

    def __init__(self, result: RunResult) -> None:
        super().__init__(result.message)
        self.result = result


def _compiles_here(spec: RunSpec, lang: Language) -> bool:
    """Whether this job compiles: a compiled language, and no artifact compiled before."""
    return lang.compile_argv is not None and (spec.prebuilt is None or lang.artifact is None)


def _is_safe_relative(name: str) -> bool:
    path = posixpath.normpath(name)
    return bool(name) and "\0" not in name and not path.startswith(("/", "..")) and path != "."


class DockerBackend:
    """A warm pool of sandbox containers (see the module docstring)."""

    name = "docker"
    deadline_margin_s = ANSWER_MARGIN_S  # the agent answers a cut run this much early

    def __init__(
        self, settings: SandboxSettings, client: docker.DockerClient | None = None
    ) -> None:
        self.settings = settings
        self._client = client
        self._own_client = client is None
        self.pool: ContainerPool | None = None
        self._runs = 0
        self._compiles = 0
        self._running = 0

    # ------------------------------------------------------------ life cycle

    async def start(self) -> None:
        if self._client is None:
            try:
                self._client = await asyncio.to_thread(docker.from_env, timeout=120)
                await asyncio.to_thread(self._client.ping)
            except docker.errors.DockerException as exc:
                raise SandboxUnavailable(
                    f"the docker backend needs a running Docker engine ({exc}); start dockerd, "
                    "or use --backend process"
                ) from exc
        try:
            await asyncio.to_thread(
                ensure_image,
                self._client,
                self.settings.docker_image,
                self.settings.docker_base_image,
            )
        except RuntimeError as exc:
            raise SandboxUnavailable(str(exc)) from exc
        self.pool = ContainerPool(self.settings, self._client)
        try:
            await self.pool.start()
        except BaseException:
            await self.pool.close()
            raise

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        if self._own_client and self._client is not None:
            self._client.close()
            self._client = None

    def status(self) -> dict[str, Any]:
        pool = self.pool.status() if self.pool else {}
        return {
            "backend": self.name,
            "image": self.settings.docker_image,
            "running": self._running,
            "runs_total": self._runs,
            "compiles_total": self._compiles,
            "cpu_shares": {"per_run": self.settings.run_cpu_shares},
            **pool,
        }

    # ------------------------------------------------------------ one program

    async def compile(self, spec: RunSpec, deadline: Deadline) -> tuple[ExecResult, bytes | None]:
        """Compile once in one container (run_tests): the result and the artifact, which the
        agent sends back when it is at most `max_output_bytes` (as on the process backend).
        Every case compiled in a container of its own: a compile error took `concurrency`
        containers, and 100 cases paid 100 compiles."""
        if self.pool is None:
            raise SandboxUnavailable("the docker backend is not started")
        lang = get_language(spec.language)
        if lang.compile_argv is None or lang.artifact is None:
            raise ValueError(f"{lang.name} has no compile step")
        bad = self._bad_path(spec)
        if bad:
            return ExecResult(status=ExecStatus.ERROR, message=bad), None
        self._running += 1
        try:
            r = await self._in_container(spec, lang, deadline, compile_only=True)
        finally:
            self._running -= 1
        # a compile the deadline or a lost agent ended is reported as the run would be
        compiled = r.compile or r.run
        if compiled is None:
            compiled = ExecResult(status=ExecStatus.ERROR, message=r.message or "sandbox failed")
        ok = compiled.status == ExecStatus.FINISHED and compiled.exit_code == 0
        return compiled, r.files.get(lang.artifact) if ok else None

    def case_batch(self, spec: RunSpec, deadline: Deadline) -> AbstractAsyncContextManager[None]:
        """run_tests: every case takes a pooled container of its own (no shared runner)."""
        return contextlib.nullcontext()

    async def run_case(self, batch: object, spec: RunSpec, deadline: Deadline) -> RunResult:
        return await self.run(spec, deadline)

    async def run(self, spec: RunSpec, deadline: Deadline) -> RunResult:
        if self.pool is None:
            raise SandboxUnavailable("the docker backend is not started")
        try:
            lang = get_language(spec.language)
        except UnknownLanguage as exc:
            return RunResult(message=str(exc), backend=self.name)
        bad = self._bad_path(spec)
        if bad:
            return RunResult(message=bad, backend=self.name)
        self._runs += 1
        self._running += 1
        try:
            return await self._in_container(spec, lang, deadline)
        finally:
            self._running -= 1

    @staticmethod
    def _bad_path(spec: RunSpec) -> str | None:
        bad = [name for name in spec.files if not _is_safe_relative(name)]
        if not bad:
            return None
        return (
            f"could not prepare the working dir: file path {bad[0]!r} leaves the workdir "
            "(use a relative path without '..')"
        )

    async def _in_container(
        self, spec: RunSpec, lang: Language, deadline: Deadline, compile_only: bool = False
    ) -> RunResult:
        """One job (the run, or only the compile) in a pooled container."""
        assert self.pool is not None
        for attempt in (1, 2):
            container = await self.pool.acquire(deadline)
            if deadline.remaining() <= ANSWER_MARGIN_S:
                # Too late for the agent to run anything and answer in time: the host would
                # stop waiting first and destroy the container (every container a late
                # run_tests case or a spent deadline took). It goes back unused instead.
                self.pool.release(container)
                run = ExecResult.expired_before_start()
                return RunResult(run=run, sandbox_id=container.name, backend=self.name)
            job = self.build_job(spec, lang, deadline, compile_only)
            if _compiles_here(spec, lang):
                self._compiles += 1
            try:
                return await self._run_in(container, job, spec, lang, deadline)
            except _AgentLost as lost:
                # A container that died while idle (removed from outside, engine restart)
                # fails at once: one more try on another container, within the deadline.
                if attempt == 2 or deadline.expired:
                    return lost.result
        raise AssertionError("unreachable")

    async def _run_in(
        self,
        container: SandboxContainer,
        job: dict[str, Any],
        spec: RunSpec,
        lang: Language,
        deadline: Deadline,
    ) -> RunResult:
        assert self.pool is not None
        container.runs += 1
        # The agent answers within the job's budget (its steps' limits, cut to the deadline);
        # silent AGENT_GRACE_S past it, it is frozen or lost, however long the deadline is.
        grace_s = job["budget_s"] + AGENT_GRACE_S
        wait_s = min(deadline.remaining(), grace_s)
        job["budget_s"] = max(0.0, min(job["budget_s"], wait_s - ANSWER_MARGIN_S))
        try:
            async with asyncio.timeout(wait_s):
                reply = await container.conn.request(job)
        except (TimeoutError, AgentError, OSError) as exc:
            # The agent could not answer in time (or died): the container may hold anything.
            self.pool.discard(container, f"no answer from the agent: {exc!r}")
            # The deadline's if it ended the wait; a silent agent is the sandbox's failure, not
            # the program's time limit (it said "deadline reached" for a call without one)
            timed_out = isinstance(exc, TimeoutError) and wait_s < grace_s
            status = ExecStatus.TIME_LIMIT if timed_out else ExecStatus.ERROR
            if timed_out:
                message = "deadline reached; sandbox destroyed"
            elif isinstance(exc, TimeoutError):
                message = (
                    f"sandbox failed: its agent did not answer within {grace_s:.3g} s (the "
                    f"run's limits and {AGENT_GRACE_S:g} s more); sandbox destroyed"
                )
            else:
                message = f"sandbox failed: {exc}"
            result = RunResult(
                run=ExecResult(status=status, message=message),
                sandbox_id=container.name,
                backend=self.name,
                message=message,
            )
            if isinstance(exc, TimeoutError):
                return result
            raise _AgentLost(result) from exc
        except asyncio.CancelledError:
            self.pool.discard(container, "run cancelled")
            raise
        self.pool.background(self._finish(container, reply))
        return self.to_result(reply, spec, lang, container.name)

    async def _finish(self, container: SandboxContainer, reply: dict[str, Any]) -> None:
        """Wait for the agent's reset report; reuse the container only when it says clean."""
        assert self.pool is not None
        oom = any(s.get("oom_killed") for s in reply.get("steps", []))
        try:
            async with asyncio.timeout(10.0):
                reset = await container.conn.receive()
        except (TimeoutError, AgentError, OSError) as exc:
            self.pool.discard(container, f"no reset report: {exc!r}")
            return
        if not reset.get("clean"):
            self.pool.discard(container, f"reset not clean: {reset.get('problems')}")
        elif oom or not reply.get("ok"):
            self.pool.discard(container, "a cgroup OOM kill or an agent error in the last run")
        else:
            self.pool.release(container)

    # ------------------------------------------------------------ wire mapping

    def build_job(
        self, spec: RunSpec, lang: Language, deadline: Deadline, compile_only: bool = False
    ) -> dict[str, Any]:
        """The agent's job: compile (unless `spec.prebuilt` is the artifact), then run; or, for
        `compile_only`, compile and send the artifact back."""
        files = {name: base64.b64encode(data).decode() for name, data in spec.files.items()}
        files[lang.source_file] = base64.b64encode(spec.code.encode()).decode()
        executable: list[str] = []
        steps = []
        if _compiles_here(spec, lang):
            assert lang.compile_argv is not None
            steps.append(self._step(list(lang.compile_argv), spec.compile_limits, b""))
        elif spec.prebuilt is not None and lang.artifact is not None:
            files[lang.artifact] = base64.b64encode(spec.prebuilt).decode()
            executable.append(lang.artifact)
        if compile_only and lang.artifact is not None:
            fetch = [lang.artifact]
            max_fetch = self.settings.max_output_bytes
        else:
            run = self._step(list(lang.run_argv), spec.run_limits, spec.stdin.encode())
            run["needs_success"] = True
            steps.append(run)
            fetch = list(spec.fetch_files)
            max_fetch = spec.run_limits.max_output_bytes or self.settings.max_output_bytes
        budget = sum(s["wall_s"] for s in steps) + 2.0
        if math.isfinite(deadline.at):
            budget = min(budget, deadline.remaining())
        return {
            "op": "run",
            "files": files,
            "executable": executable,
            "steps": steps,
            "fetch": fetch,
            "max_fetch_bytes": max_fetch,
            "budget_s": budget,
        }

    def _step(self, argv: list[str], limits: Limits, stdin: bytes) -> dict[str, Any]:
        s = self.settings
        return {
            "argv": argv,
            "env": CHILD_ENV,
            "stdin": base64.b64encode(stdin).decode(),
            "wall_s": limits.wall_time_s,
            "cpu_s": math.ceil(limits.cpu_time_s or limits.wall_time_s) + 1,
            "memory_mb": limits.memory_mb or s.default_memory_mb,
            "fsize_mb": limits.max_file_size_mb or s.max_file_size_mb,
            "nofile": limits.max_open_files or s.max_open_files,
            "max_output": limits.max_output_bytes or s.default_output_bytes,
        }

    def to_result(
        self, reply: dict[str, Any], spec: RunSpec, lang: Language, sandbox_id: str
    ) -> RunResult:
        result = RunResult(sandbox_id=sandbox_id, backend=self.name)
        if not reply.get("ok"):
            result.message = reply.get("error", "the sandbox failed")
        steps = list(reply.get("steps", []))
        if _compiles_here(spec, lang) and steps:
            result.compile = self._exec_result(steps.pop(0), spec.compile_limits)
            if result.compile.status != ExecStatus.FINISHED or result.compile.exit_code != 0:
                result.message = result.message or result.compile.compile_failure()
        if steps:
            result.run = self._exec_result(steps.pop(0), spec.run_limits)
        result.files = {k: base64.b64decode(v) for k, v in reply.get("files", {}).items()}
        return result

    def _exec_result(self, step: dict[str, Any], limits: Limits) -> ExecResult:
        stderr = decode_output(
            base64.b64decode(step["stderr"]), step.get("stderr_truncated", False)
        )
        status = ExecStatus(step["status"])
        asked_mb = limits.memory_mb or self.settings.default_memory_mb
        # the container's limit bounds a run that asked for more (it said "memory limit of
        # 4096 MB exceeded" for a run the container's 1024 MB ended)
        memory_mb = min(asked_mb, self.settings.docker_memory_mb)
        message = ""
        if status == ExecStatus.FINISHED and self._hit_memory(step, stderr, memory_mb):
            status = ExecStatus.MEMORY_LIMIT
        if status == ExecStatus.TIME_LIMIT:
            message = self._time_limit_message(step, limits)
        elif status == ExecStatus.MEMORY_LIMIT:
            message = f"memory limit of {memory_mb} MB exceeded"
            if memory_mb < asked_mb:
                message += f" (the container's docker_memory_mb, below the {asked_mb} MB asked)"
        elif status == ExecStatus.OUTPUT_LIMIT:
            cap = limits.max_output_bytes or self.settings.default_output_bytes
            stream = (
                "stderr"
                if step.get("stderr_truncated") and not step.get("stdout_truncated")
                else "stdout"
            )
            # the process backend's words: which stream (it said "output limit of N bytes")
            message = output_limit_message(stream, cap, step.get("signal"))
        # The agent reports a signal death as the shell does (128 + N); the wire's return_code
        # is -N then, as on the process backend (a program's own exit(137) stays 137).
        sig = step.get("signal")
        return ExecResult(
            status=status,
            exit_code=-sig if sig else step.get("exit_code"),
            signal=sig,
            stdout=decode_output(
                base64.b64decode(step["stdout"]), step.get("stdout_truncated", False)
            ),
            stderr=stderr,
            stdout_truncated=step.get("stdout_truncated", False),
            stderr_truncated=step.get("stderr_truncated", False),
            # microseconds, as the process backend reports them (not the agent's 15 digits)
            wall_time_s=round(step.get("wall_s", 0.0), 6),
            cpu_time_s=round(step["cpu_s"], 6) if step.get("cpu_s") is not None else None,
            peak_memory_kb=step.get("maxrss_kb"),
            message=message,
        )

    @staticmethod
    def _time_limit_message(step: dict[str, Any], limits: Limits) -> str:
        """Which limit ended the step, in the process backend's words: the wall-clock limit, the
        CPU time, or the request's deadline (it said "wall 10.0 s or CPU time" for a case the
        deadline cut after 0.35 s)."""
        wall, used = limits.wall_time_s, float(step.get("wall_s") or 0.0)
        cpu_limit = math.ceil(limits.cpu_time_s or wall) + 1
        if step.get("signal") == signal.SIGXCPU or (step.get("cpu_s") or 0.0) >= cpu_limit:
            return f"CPU-time limit of {cpu_limit} s exceeded"
        if used >= wall:
            return f"wall-clock limit of {wall:.3g} s exceeded"
        return f"the request deadline ended it after {used:.3g} s (its own limit: {wall:.3g} s)"

    @staticmethod
    def _hit_memory(step: dict[str, Any], stderr: str, memory_mb: int) -> bool:
        """The address-space limit shows as a failed allocation, the cgroup as an OOM kill."""
        if step.get("oom_killed"):
            return True
        if step.get("exit_code") in (0, None):
            return False
        if any(marker in stderr[-4096:] for marker in MEMORY_ERROR_MARKERS):
            return True
        near_limit = (step.get("maxrss_kb") or 0) >= memory_mb * 1024 * 0.9
        return step.get("signal") in (signal.SIGSEGV, signal.SIGABRT, signal.SIGKILL) and near_limit
