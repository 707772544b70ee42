"""One tool at run time: admission, the deadline, hedging, retries and metrics around a backend.

The call itself runs in its own task holding the concurrency slot. The caller waits for it under
the deadline; at expiry the caller answers at once and the task is cancelled without waiting for
its clean-up (closing the upstream connection, or unwinding the in-process handler, which is where
a sandbox kills its process), so no caller waits on someone else's slow shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from toolenv_core.admission import Admission, Rejected
from toolenv_core.deadline import HEADER_RESOLUTION_S, Deadline, DeadlinePolicy, header_value_at
from toolenv_core.disconnect import caller_left
from toolenv_core.headers import DEADLINE as DEADLINE_HEADER
from toolenv_core.hedging import HELD_FAILURE_MARGIN_S, another_attempt_may_do_better

from .metrics import GatewayMetrics
from .policies import LatencyWindow, RetryBudget
from .settings import ToolConfig
from .upstream import (
    DEADLINE_EXPIRED_HEADER,
    AppNotStarted,
    Backend,
    Endpoint,
    RemoteBackend,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamReply,
    UpstreamTooLarge,
    pick,
    pick_another,
)

log = logging.getLogger("toolenv.gateway")

TOLD_DEADLINE_SLACK_S = 2 * HEADER_RESOLUTION_S
"""How much before the deadline it was told a tool's 504 still counts as that deadline's (the
header and a loop's timers may count whole milliseconds); below HELD_FAILURE_MARGIN_S, so that
an early 504 a hedged call held is answered as the tool's, not as the deadline's."""


@dataclass(slots=True)
class UpstreamCall:
    """One call as the tool gets it. `reserve_s` shortens the deadline the tool is told, so that a
    tool which answers at its deadline in its own format (sandboxd's TimeLimitExceeded with the
    output so far) does so before the gateway's own timer fires. Not frozen: one is made per call,
    and a frozen dataclass's `__init__` costs four times as much; nothing changes it after but
    `queue_wait_s`."""

    method: str
    path: str
    body: bytes
    headers: dict[str, str]
    deadline: Deadline
    reserve_s: float = 0.0
    # set by the runtime once known, for the log line of a call cancelled meanwhile (its caller
    # gone, the shutdown), which the runtime returns no outcome for
    queue_wait_s: float = 0.0

    def told_deadline_passed(self) -> bool:
        """Whether the deadline the tool was told (`send_headers`) has run out, within
        `TOLD_DEADLINE_SLACK_S`: a 504 before it is not the tool stopping at it."""
        return time.monotonic() >= self.deadline.at - self.reserve_s - TOLD_DEADLINE_SLACK_S

    def send_headers(self) -> dict[str, str]:
        """`headers` and the deadline the tool is told, remaining now (what
        `Deadline(at - reserve_s).headers()` gives, without the objects on every call)."""
        at = self.deadline.at - self.reserve_s
        if at == math.inf:
            return self.headers
        headers = self.headers.copy()
        headers[DEADLINE_HEADER] = header_value_at(at)
        return headers


@dataclass(slots=True)
class Outcome:
    """How a call ended, as the routes need it to answer."""

    kind: str  # ok | error | timeout | rejected | unavailable | upstream_failed | caller_gone
    # | cut_by_shutdown (`cancelled_kind`)
    reply: UpstreamReply | None = None
    error: str | None = None
    elapsed_s: float = 0.0
    queue_wait_s: float = 0.0
    retry_after: str | None = None
    deadline_ms: float | None = None


def cancelled_kind() -> str:
    """The outcome of a call whose task was cancelled: its caller hung up (`caller_gone`), or the
    server cut it (`cut_by_shutdown`: uvicorn, once shutdown_grace_s ran out; answered 503)."""
    return "caller_gone" if caller_left() else "cut_by_shutdown"


class Expiry:
    """`asyncio.timeout(delay)` with the same semantics (the task is cancelled at expiry and the
    block's CancelledError leaves as TimeoutError; a cancellation from elsewhere stays one) at
    about half its cost: one timer handle and no state machine, on every call's path."""

    __slots__ = ("delay", "loop", "task", "handle", "fired", "cancelling")

    def __init__(self, delay: float, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.delay = delay
        self.loop = loop  # the running loop, if the caller has it (looking it up costs a getpid)
        self.task: asyncio.Task | None = None
        self.handle: asyncio.TimerHandle | None = None
        self.fired = False
        self.cancelling = 0

    async def __aenter__(self) -> Expiry:
        loop = self.loop or asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None
        self.task = task
        self.cancelling = task.cancelling()
        self.handle = loop.call_later(max(0.0, self.delay), self._fire)
        return self

    def _fire(self) -> None:
        self.fired = True
        assert self.task is not None
        self.task.cancel()

    async def __aexit__(self, exc_type, exc, tb) -> None:
        assert self.handle is not None and self.task is not None
        self.handle.cancel()
        if (
            self.fired
            and self.task.uncancel() <= self.cancelling
            and exc_type is asyncio.CancelledError
        ):
            raise TimeoutError from exc


class ToolRuntime:
    def __init__(self, config: ToolConfig, backend: Backend, metrics: GatewayMetrics) -> None:
        self.config = config
        self.name = config.name
        self.backend = backend
        self.admission = Admission(config.name, config.concurrency, config.queue)
        self.m = metrics.for_tool(config.name)
        self.window = LatencyWindow(config.hedge)
        self.budget = RetryBudget(config.retry)
        self.hedging = config.hedge.enabled and config.is_idempotent
        self.deadlines = DeadlinePolicy.from_ms(config.deadline_default_ms, config.max_deadline_ms)
        self._tasks: set[asyncio.Task[UpstreamReply]] = set()
        self._turn = 0
        # In-process handlers may take a while to unwind (a sandbox reaping its process): those
        # calls run in their own task so the caller can be answered before the unwinding ends.
        self.inline = isinstance(backend, RemoteBackend) and not self.hedging
        self.one_try = not self.hedging and not config.retry.enabled  # one send, no wrapper
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop calls run on, once seen

    # ---------------------------------------------------------------- public

    def deadline_for(
        self, header_value: str | None, body_ms: float | None = None
    ) -> tuple[Deadline, float]:
        """The call's deadline and its budget in ms, by the one rule (`DeadlinePolicy`): the
        earlier of the header and the body's `deadline_ms`, else the tool's default, capped by
        the tool's maximum. Raises DeadlineHeaderError for a malformed header."""
        seconds = self.deadlines.budget_s(header_value, body_ms)
        assert seconds is not None  # a tool always has a default
        return Deadline.after(seconds), round(seconds * 1000.0, 3)

    async def call(self, call: UpstreamCall, deadline_ms: float) -> Outcome:
        started = time.perf_counter()
        try:
            outcome = await self._call(call, started)
        except asyncio.CancelledError:  # the caller hung up, or the server's shutdown cut it
            self.m.total.observe(time.perf_counter() - started)  # a call like any other
            self.m.outcomes[cancelled_kind()].inc()
            raise
        outcome.elapsed_s = time.perf_counter() - started
        outcome.deadline_ms = deadline_ms
        self.m.total.observe(outcome.elapsed_s)
        self.m.outcomes[outcome.kind].inc()
        if outcome.reply is not None:
            injected = outcome.reply.injected_delay_s
            if injected is not None:
                self.m.injected_delay.observe(injected)
        return outcome

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=10)

    # ---------------------------------------------------------------- internals

    async def _call(self, call: UpstreamCall, started: float) -> Outcome:
        remaining = call.deadline.remaining()
        if remaining - call.reserve_s < HEADER_RESOLUTION_S:
            # The tool would be told 0 ms, which it reads as expired: answered here, as a deadline
            # that ran out in the queue (no slot taken, nothing sent).
            return self._timed_out("it had expired when the call arrived")
        task: asyncio.Task[UpstreamReply] | None = None
        admitted = False
        queue_wait = 0.0
        if self.config.retry.enabled:
            self.budget.record_call()  # what retries are budgeted by
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        try:
            async with Expiry(remaining, loop):
                if not self.admission.try_acquire():
                    await self.admission.acquire()
                admitted = True
                queue_wait = call.queue_wait_s = time.perf_counter() - started
                self.m.queue_wait.observe(queue_wait)
                if self.inline:
                    # Proxy without hedging: cancelling aborts the connection synchronously, so
                    # the call can run right here (no task) and still answer at once.
                    try:
                        if self.one_try:  # `_attempts`' one send, without its frame
                            reply = await self._send_once(self._next_endpoint(), call)
                        else:
                            reply = await self._attempts(call)
                    finally:
                        self.admission.release(time.perf_counter() - started - queue_wait)
                else:
                    task = loop.create_task(self._attempts(call))
                    self._tasks.add(task)
                    task.add_done_callback(self._release_when_done(time.perf_counter()))
                    reply = await asyncio.shield(task)
        except TimeoutError:
            if task is not None:
                task.cancel()  # clean-up continues in the background; we answer now
            if not admitted:
                # its whole wait was for a slot: logged and observed as such (it was 0 ms and
                # left out, so a queue that outlasted the deadlines looked empty)
                queue_wait = time.perf_counter() - started
                self.m.queue_wait.observe(queue_wait)
            where = "waiting for the upstream" if admitted else "waiting for a slot"
            return self._timed_out(where, queue_wait)
        except Rejected as exc:
            return Outcome("rejected", error=str(exc), retry_after=exc.retry_after_header)
        except UpstreamConnectError as exc:
            # an in-process app that did not start says so ("no upstream reachable" was wrong)
            why = str(exc) if isinstance(exc, AppNotStarted) else f"no upstream reachable ({exc})"
            return Outcome(
                "unavailable",
                error=f"tool {self.name!r} is unavailable: {why}",
                queue_wait_s=queue_wait,
            )
        except UpstreamTooLarge as exc:
            return Outcome(
                "upstream_failed", error=f"tool {self.name!r}: {exc}", queue_wait_s=queue_wait
            )
        except UpstreamBroken as exc:
            return Outcome(
                "upstream_failed",
                error=f"tool {self.name!r} failed mid-request: {exc}",
                queue_wait_s=queue_wait,
            )
        except asyncio.CancelledError:
            if task is not None:
                task.cancel()  # the caller went away: so does the upstream work
            if not admitted:  # it left the queue: its wait was one (logged as 0 ms before)
                call.queue_wait_s = time.perf_counter() - started
                self.m.queue_wait.observe(call.queue_wait_s)
            raise
        except Exception as exc:  # a bug, not the upstream: say so without a stack in the answer
            log.exception("gateway error", extra={"tool": self.name})
            return Outcome(
                "upstream_failed",
                error=f"tool {self.name!r}: gateway error {type(exc).__name__}",
                queue_wait_s=queue_wait,
            )
        if reply.status == 504 and (
            DEADLINE_EXPIRED_HEADER in reply.headers or call.told_deadline_passed()
        ):
            # The tool stopped at the deadline we forwarded, a moment before our own timer fired:
            # the same outcome, so callers and metrics see one kind of timeout, not two. A 504
            # sooner is the tool's own answer (an emulator's `error` fault with status 504): it
            # was a timeout "within the deadline" 30 s early, the tool's body lost.
            return self._timed_out("the tool stopped at it", queue_wait)
        if DEADLINE_EXPIRED_HEADER in reply.headers:
            # The same, answered in the tool's own format (sandboxd's TimeLimitExceeded with the
            # output so far, HTTP 200): a timeout too, which keeps the reply for the routes that
            # pass the tool's body on (the generic call answers its 504).
            return self._timed_out("the tool stopped at it", queue_wait, reply)
        kind = "ok" if reply.status < 400 else "error"
        error = None if kind == "ok" else f"tool {self.name!r} answered HTTP {reply.status}"
        return Outcome(kind, reply=reply, error=error, queue_wait_s=queue_wait)

    def _timed_out(
        self, where: str, queue_wait: float = 0.0, reply: UpstreamReply | None = None
    ) -> Outcome:
        """The one timeout outcome, saying where the deadline ran out (`reply`: the tool's own
        answer at its deadline, when it gave one in its format)."""
        return Outcome(
            "timeout",
            reply=reply,
            error=f"tool {self.name!r} did not answer within the deadline ({where})",
            queue_wait_s=queue_wait,
        )

    def _release_when_done(self, started: float) -> Callable[[asyncio.Task[UpstreamReply]], None]:
        """The slot is held until the task has really ended (even if cancelled before it ran)."""

        def done(task: asyncio.Task[UpstreamReply]) -> None:
            self._tasks.discard(task)
            self.admission.release(time.perf_counter() - started)
            if not task.cancelled():
                task.exception()  # retrieved: an answer nobody waits for any more is not an error

        return done

    async def _attempts(self, call: UpstreamCall) -> UpstreamReply:
        """Runs in its own task; the slot is released when it ends."""
        first = self._next_endpoint()
        if self.one_try:
            return await self._send_once(first, call)  # `_attempt` without retries
        if not self.hedging:
            return await self._attempt(first, call)
        return await self._hedged(first, call)

    def _next_endpoint(self) -> Endpoint:
        """The endpoint a call's first attempt goes to (its turn of the rotation)."""
        self._turn += 1
        return pick(self.backend.endpoints, turn=self._turn)

    async def _hedged(self, first: Endpoint, call: UpstreamCall) -> UpstreamReply:
        """The first attempt, a hedge once it is slower than the window's quantile, the first
        answer wins (a 5xx or 429 only once the other attempt has failed too). The window learns the call's latency (first send to winning answer), as the
        rollout simulator's does: learning the winning attempt's own latency (a hedge's, started
        late) left the slow first attempts out, so the quantile sank and far more calls than the
        configured share were hedged (about sqrt(1 - quantile): 22% at p95)."""
        used = [first]  # where this call's attempts went: hedge and retries go elsewhere
        sent = time.perf_counter()
        reply = await self._race(first, call, used)
        if reply.status < 400:
            # What hedges are timed by: successful calls' latencies only, as the window says and
            # the rollout simulator's learns. A 429 (a throttle answers at once) or another 4xx
            # taught it near-zero latencies: the quantile sank and far more calls were hedged.
            self.window.add(time.perf_counter() - sent)
        return reply

    async def _race(
        self, first: Endpoint, call: UpstreamCall, used: list[Endpoint]
    ) -> UpstreamReply:
        a1 = asyncio.create_task(self._attempt(first, call, used))
        pending: set[asyncio.Task[UpstreamReply]] = {a1}
        try:
            delay = self.window.hedge_delay()
            if delay is not None:
                done, pending = await asyncio.wait(pending, timeout=delay)
                if not done:
                    second = pick_another(self.backend.endpoints, used, self._turn)
                    if second.healthy:  # never a hedge to an upstream known to be down
                        used.append(second)
                        self.m.hedged.inc()
                        pending.add(asyncio.create_task(self._attempt(second, call, used)))
                else:
                    pending = done
            error: BaseException | None = None
            held: UpstreamReply | None = None  # a 5xx or 429 while the other attempt runs
            while pending:
                wait_s = None
                if held is not None and call.deadline.bounded:
                    wait_s = max(call.deadline.remaining() - HELD_FAILURE_MARGIN_S, 0.0)
                elif held is not None:
                    return held  # no deadline bounds the wait for the other attempt
                done, pending = await asyncio.wait(
                    pending, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED
                )
                if not done:  # a wait is bounded only while a failure is held
                    assert held is not None
                    return held  # the deadline is near: the failure in hand, not a timeout
                for task in done:
                    if task.exception() is not None:
                        error = task.exception()
                    elif not another_attempt_may_do_better(task.result().status):
                        return task.result()  # the first answer that is not a failure wins
                    else:
                        held = held or task.result()
            if held is not None:
                return held
            assert error is not None
            raise error
        finally:
            for task in pending:
                task.cancel()  # the loser's connection is closed: the upstream stops working on it

    async def _attempt(
        self, endpoint: Endpoint, call: UpstreamCall, used: list[Endpoint] | None = None
    ) -> UpstreamReply:
        """`endpoint`, then retries (`used`: where the call's attempts went, shared with a hedge)."""
        attempt = 1
        at_deadline = False  # a backoff cut short by the deadline: that retry is the last
        while True:
            try:
                return await self._send_once(endpoint, call)
            except (UpstreamConnectError, UpstreamBroken) as exc:
                # A broken call may have done its work: retried only when doing it twice is safe.
                policy = self.config.retry
                if isinstance(exc, UpstreamBroken) and not self.config.is_idempotent:
                    raise
                if isinstance(exc, UpstreamTooLarge):
                    raise  # another upstream would answer the same call as large
                if at_deadline or not (policy.enabled and attempt < policy.max_attempts):
                    if attempt > 1:
                        raise type(exc)(f"{exc}; {attempt} attempts made") from exc
                    raise
                if call.deadline.remaining() <= 0:
                    raise
                if not self.budget.try_spend():
                    # Said so: else a call the docs promise retries for fails at once, unexplained.
                    raise type(exc)(
                        f"{exc}; not retried after {attempt} attempt(s): the tool's retry budget "
                        f"is spent, {policy.budget_ratio} retries per call made plus "
                        f"{policy.min_retries_per_s} per second (its retry.budget_ratio and "
                        "retry.min_retries_per_s)"
                    ) from exc
                self.m.retried.inc()
                wait = policy.backoff_ms / 1000 * 2 ** (attempt - 1)
                if wait:
                    # Past the deadline's last 50 ms no backoff fits: one retry there, not the
                    # rest of max_attempts back to back (each spending the tool's retry budget).
                    left = max(call.deadline.remaining() - 0.05, 0)
                    at_deadline = wait >= left
                    await asyncio.sleep(min(wait, left))
                attempt += 1
                if used is None:
                    used = [endpoint]
                endpoint = pick_another(self.backend.endpoints, used, self._turn)
                used.append(endpoint)

    async def _send_once(self, endpoint: Endpoint, call: UpstreamCall) -> UpstreamReply:
        endpoint.outstanding += 1
        sent = time.perf_counter()
        try:
            reply = await self.backend.send(
                endpoint, call.method, call.path, call.body, call.send_headers()
            )
        finally:
            endpoint.outstanding -= 1
        self.m.upstream.observe(time.perf_counter() - sent)
        return reply
