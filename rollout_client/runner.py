"""Runs rollout steps: trajectories through an engine and the gateway, under a policy.

One trajectory is a loop of turns: wait as the policy says, generate the turn's forced number of
tokens, then make the turn's tool calls through the gateway and append their responses to the
context. A step launches its trajectories as tasks and closes when the policy says; the
trajectories still running are cancelled (their engine requests aborted) and either carried over
to the next step, resuming where they stopped, or aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from toolenv_core.deadline import Deadline
from toolenv_core.polytrace import ToolCallRecord, TurnRecord

from .clock import now
from .engines.base import Engine, Generation, PrefixCacheStats
from .gateway_client import GatewayClient, ToolOutcome
from .policies import Event, Policy
from .trajectory import TrajectoryState
from .workloads.live import LiveDriver
from .workloads.plan import TokenSynth, TrajectoryPlan


@dataclass
class RunnerOptions:
    batch: int = 64  # trajectories that complete a step (N)
    steps: int = 1
    observation_tokens: int = 16  # what a timeout or error appends to the context
    vocab_size: int = 1024
    lengths_only: bool = False  # token ids carry no information (simulated engine)


@dataclass
class StepOutcome:
    step: int
    started: float
    ended: float
    launched: int
    done: list[TrajectoryState]
    carried: list[TrajectoryState]
    aborted: list[TrajectoryState]
    states: list[TrajectoryState]
    prefix_cache: PrefixCacheStats | None = None
    wasted_tokens: int = 0
    # Tool calls still unanswered when the step closed: cancelled with their trajectory (made
    # again if it is carried over), so in no call record; a hung call ends here under overlap.
    abandoned_calls: int = 0
    extra: dict = field(default_factory=dict)


class Runner:
    def __init__(
        self,
        engine: Engine,
        gateway: GatewayClient,
        policy: Policy,
        options: RunnerOptions,
        on_event: Callable[[Event], None] | None = None,
        live: LiveDriver | None = None,
    ) -> None:
        self.live = live
        self.engine = engine
        self.gateway = gateway
        self.policy = policy
        self.options = options
        self.synth = TokenSynth(vocab_size=options.vocab_size, lengths_only=options.lengths_only)
        self._on_event = on_event
        self._step_start = 0.0

    def _emit(self, kind: str, st: TrajectoryState, turn: int) -> None:
        event = Event(kind, st.trajectory_id, turn, now() - self._step_start)  # type: ignore[arg-type]
        self.policy.on_event(event)
        if self._on_event is not None:
            self._on_event(event)

    async def run(
        self, plans: Iterator[TrajectoryPlan], on_step: Callable[[StepOutcome], None] | None = None
    ) -> list[StepOutcome]:
        """Run up to `steps` steps; a step launches N' minus the carried-over trajectories."""
        outcomes: list[StepOutcome] = []
        carried: list[TrajectoryState] = []
        for step in range(self.options.steps):
            want = max(0, self.policy.launch_count(self.options.batch) - len(carried))
            fresh = [
                TrajectoryState(p, step, self.synth)
                for _, p in zip(range(want), plans, strict=False)
            ]
            if not fresh and not carried:
                break
            outcome = await self.run_step(step, fresh, carried)
            if on_step is not None:
                on_step(outcome)
            outcomes.append(outcome)
            carried = outcome.carried
        return outcomes

    async def run_step(
        self, step: int, fresh: list[TrajectoryState], carried: list[TrajectoryState]
    ) -> StepOutcome:
        states = [*carried, *fresh]
        for st in states:
            st.new_step()
            st.status = "running"
        self.policy.begin_step(step)
        cache_before = await self.engine.prefix_cache_stats()
        self._step_start = started = now()
        tasks = {
            asyncio.create_task(self._trajectory(st, step), name=st.trajectory_id): st
            for st in states
        }
        # Finished tasks arrive in completion order (deterministic, and O(1) per completion:
        # `asyncio.wait` over thousands of pending tasks would cost O(n) each time).
        finished: asyncio.Queue[asyncio.Task[None]] = asyncio.Queue()
        for task in tasks:
            task.add_done_callback(finished.put_nowait)
        close_after = self.policy.close_when_done(self.options.batch)
        done: list[TrajectoryState] = []
        seen: set[asyncio.Task[None]] = set()

        def record(task: asyncio.Task[None]) -> None:
            seen.add(task)
            st = tasks[task]
            st.finished_at = now() - started
            if not task.cancelled() and task.exception() is not None:
                exc = task.exception()
                st.status, st.error = "failed", f"{type(exc).__name__}: {exc}"
            done.append(st)

        try:
            while len(done) < min(close_after, len(tasks)):
                record(await finished.get())
        finally:
            ended = now()
            for task in tasks:  # finished at this same instant, not dequeued yet
                if task.done() and task not in seen and not task.cancelled():
                    record(task)
            pending = [t for t in tasks if not t.done()]
            abandoned = sum(1 for t in pending if tasks[t].in_call)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        mode = self.policy.unfinished() or "abort"
        unfinished = [tasks[t] for t in pending]
        wasted = 0
        for st in unfinished:
            if mode == "carry":
                st.status = "carried"
            else:
                st.status = "aborted"
                wasted += st.generated_tokens
        cache_after = await self.engine.prefix_cache_stats()
        cache = (
            cache_after - cache_before
            if cache_after is not None and cache_before is not None
            else None
        )
        return StepOutcome(
            step=step,
            started=started,
            ended=ended,
            launched=len(states),
            done=[s for s in done if s.status == "done"]
            + [s for s in done if s.status == "failed"],
            carried=[s for s in unfinished if s.status == "carried"],
            aborted=[s for s in unfinished if s.status == "aborted"],
            states=states,
            prefix_cache=cache,
            wasted_tokens=wasted,
            abandoned_calls=abandoned,
        )

    async def _trajectory(self, st: TrajectoryState, step: int) -> None:
        st.steps_run += 1
        self.policy.join(st)
        try:
            while st.next_turn < len(st.plan.turns):
                turn = st.next_turn
                plan = st.plan.turns[turn]
                if not st.generated:
                    await self._generate(st, turn, step)
                for k in range(st.calls_done, len(plan.calls)):
                    await self._tool_call(st, turn, k, step)
                    st.calls_done = k + 1
                st.next_turn, st.calls_done, st.generated = turn + 1, 0, False
            st.status = "done"
            st.finished_step = step
            self._emit("trajectory_done", st, st.next_turn - 1)
        finally:
            self.policy.leave(st)

    async def _generate(self, st: TrajectoryState, turn: int, step: int) -> None:
        plan = st.plan.turns[turn]
        waited = now()
        await self.policy.before_turn(st, turn)
        st.times.barrier_s += now() - waited
        remaining = plan.output_tokens - len(st.partial)
        prompt = st.context + st.partial
        st.attempts += 1
        gen = Generation(f"{st.trajectory_id}-t{turn}-a{st.attempts}", [], len(prompt), now())
        try:
            async for _ in self.engine.stream(
                gen.request_id,
                prompt,
                max_tokens=remaining,
                min_tokens=remaining if plan.forced else 0,
                ignore_eos=plan.forced,
                route_key=st.trajectory_id,
                generation=gen,
            ):
                pass
        finally:
            st.partial.extend(gen.token_ids)
            st.generated_tokens += len(gen.token_ids)
            st.times.tokens += len(gen.token_ids)
            st.times.queue_s += gen.queue_s
            st.times.generate_s += gen.decode_s
        turn_prompt = len(st.context)
        if self.live is not None:
            self.live.after_turn(st.plan, turn, st.partial, gen.finish_reason)
        st.context.extend(st.partial)
        st.turns.append(
            TurnRecord(
                turn=turn,
                prompt_tokens=turn_prompt,
                generation_prompt_len=turn_prompt,
                cached_tokens=gen.cached_tokens,
                completion_tokens=len(st.partial),
                max_new_tokens=plan.output_tokens,
                assistant_append_len=len(st.partial),
                total_len_after=len(st.context),
                finish_reason=plan.finish_reason,
                tool_call_count=len(plan.calls),
                engine_latency_s=round((gen.finished_at or gen.submitted_at) - gen.submitted_at, 6),
            )
        )
        st.partial = []
        st.generated = True
        self._emit("turn_done", st, turn)

    async def _tool_call(self, st: TrajectoryState, turn: int, k: int, step: int) -> None:
        call = st.plan.turns[turn].calls[k]
        limit = self.policy.tool_deadline_s()
        deadline = Deadline(now() + limit) if limit is not None else None
        started = now()
        malformed = call.live_error  # live mode: the model wrote a bad call
        st.in_call = True
        try:
            if malformed:
                outcome = ToolOutcome("error", 0.0, error=malformed)
            else:
                outcome = await self.gateway.call(
                    call.tool,
                    call.arguments,
                    deadline=deadline,
                    trajectory_id=st.trajectory_id,
                    step=step,
                    turn=turn,
                )
        finally:
            st.in_call = False
            st.times.tool_s += now() - started
        if outcome.status == "ok":
            append, status = call.append_tokens, "success"
            self._emit("tool_done", st, turn)
        elif outcome.status == "timeout":
            append, status = self.options.observation_tokens, "timeout"
            st.timeouts += 1
            self._emit("tool_timeout", st, turn)
        else:
            append, status = self.options.observation_tokens, "error"
            st.tool_errors += 1
            self._emit("tool_error", st, turn)
        if self.live is not None:
            observation = self.live.observation_ids(outcome.status, outcome.result, outcome.error)
            append = len(observation)
        else:
            observation = self.synth.ids(f"{st.trajectory_id}/t{turn}/c{k}/{status}", append)
        st.context.extend(observation)
        record = ToolCallRecord(
            turn=turn,
            tool_name=call.tool,
            latency_s=round(outcome.elapsed_s, 6),
            status=status,
            query_count=call.query_count,
            response_token_len=append,
            append_len=append,
            trajectory_id=st.trajectory_id,
            step=step,
            error=outcome.error or None,
            recorded_latency_s=call.recorded_latency_s,
        )
        st.calls.append(record)
