"""The one interface every engine implements: token ids in, token ids out, streaming, abort.

Policies and workloads never see which engine runs; they call `generate` (or `stream`) and
`abort`. Every engine shares `EngineMonitor`, which records how many requests are in flight over
time: that timeline gives the engine busy fraction and the mean batch occupancy (the GPU-idle
proxy) the same way for vLLM, an OpenAI server and the simulator.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..clock import now


@dataclass(slots=True)
class Generation:
    """What one request produced, with the timings the metrics need."""

    request_id: str
    token_ids: list[int]
    prompt_len: int
    submitted_at: float
    first_token_at: float | None = None
    finished_at: float | None = None
    cached_tokens: int | None = None  # prefix-cache hits the engine itself reported
    finish_reason: str | None = None
    aborted: bool = False

    @property
    def queue_s(self) -> float:
        """Submit to first token: waiting for a batch slot plus the prefill."""
        if self.first_token_at is None:
            return (self.finished_at or self.submitted_at) - self.submitted_at
        return self.first_token_at - self.submitted_at

    @property
    def decode_s(self) -> float:
        if self.first_token_at is None or self.finished_at is None:
            return 0.0
        return self.finished_at - self.first_token_at


@dataclass(slots=True)
class Chunk:
    """New tokens from one engine step (and, on the last chunk, why it finished)."""

    token_ids: list[int]
    finish_reason: str | None = None
    cached_tokens: int | None = None
    first_token_at: float | None = None  # when a chunk carries tokens made earlier (simulators)


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache counters as the engine itself counts them (tokens)."""

    queries: float
    hits: float

    def __sub__(self, other: PrefixCacheStats) -> PrefixCacheStats:
        return PrefixCacheStats(self.queries - other.queries, self.hits - other.hits)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class EngineMonitor:
    """Time series of the number of requests in flight, from which busy fraction and occupancy follow."""

    capacity: int
    events: list[tuple[float, int]] = field(default_factory=list)
    in_flight: int = 0

    def change(self, delta: int, at: float | None = None) -> None:
        self.in_flight += delta
        self.events.append((now() if at is None else at, self.in_flight))

    def window(self, start: float, end: float) -> tuple[float, float]:
        """(busy fraction, mean batch occupancy as a fraction of capacity) over [start, end]."""
        if end <= start:
            return 0.0, 0.0
        busy = 0.0
        area = 0.0
        level = 0
        t_prev = start
        for t, n in self.events:
            if t <= start:
                level = n
                continue
            if t >= end:
                break
            busy += (t - t_prev) if level > 0 else 0.0
            area += (t - t_prev) * min(level, self.capacity)
            t_prev, level = t, n
        busy += (end - t_prev) if level > 0 else 0.0
        area += (end - t_prev) * min(level, self.capacity)
        span = end - start
        return busy / span, area / span / max(1, self.capacity)

    def timeline(self, start: float, end: float) -> list[tuple[float, int]]:
        """(seconds since start, in flight) points inside [start, end], for the busy-timeline plot."""
        level = 0
        points: list[tuple[float, int]] = []
        for t, n in self.events:
            if t <= start:
                level = n
                continue
            if t > end:
                break
            points.append((t - start, n))
        return [(0.0, level), *points, (end - start, points[-1][1] if points else level)]


class EngineUnreachable(RuntimeError):
    """The engine does not answer, or died mid-run (one line, for the CLI: exit 3)."""


class Engine(ABC):
    """Async token-id generation with forced lengths and abort."""

    name: str = "engine"
    vocab_size: int | None = None  # token ids must stay below this, when the engine knows it
    block_size: int = 16  # prefix-cache granularity in tokens, as the engine counts hits
    prefill_budget_tokens: int = 8192  # prompt tokens the engine prefills per step at most

    def __init__(self, capacity: int) -> None:
        self.monitor = EngineMonitor(capacity=capacity)

    async def start(self) -> None:  # noqa: B027
        """Bring the engine up (load weights, check the server answers)."""

    async def close(self) -> None:  # noqa: B027
        """Release everything the engine holds."""

    @abstractmethod
    def _raw_stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        min_tokens: int,
        ignore_eos: bool,
        route_key: str | None,
    ) -> AsyncIterator[Chunk]:
        """The engine-specific part: yield chunks of new token ids as the engine makes them."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a running request; tokens already streamed stay with the caller."""

    async def stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        route_key: str | None = None,
        generation: Generation | None = None,
    ) -> AsyncIterator[list[int]]:
        """Yield chunks of new token ids; record timings and tokens on `generation` if given.

        If the consumer stops early or is cancelled, the request is aborted in the engine.
        """
        gen = generation or Generation(request_id, [], len(prompt_ids), now())
        self.monitor.change(+1)
        done = False
        try:
            async for chunk in self._raw_stream(
                request_id, prompt_ids, max_tokens, min_tokens, ignore_eos, route_key
            ):
                if chunk.token_ids:
                    if gen.first_token_at is None:
                        gen.first_token_at = (
                            now() if chunk.first_token_at is None else chunk.first_token_at
                        )
                    gen.token_ids.extend(chunk.token_ids)
                if chunk.cached_tokens is not None:
                    gen.cached_tokens = chunk.cached_tokens
                if chunk.finish_reason is not None:
                    gen.finish_reason = chunk.finish_reason
                if chunk.token_ids:
                    yield chunk.token_ids
            done = True
        finally:
            gen.finished_at = now()
            self.monitor.change(-1)
            if not done:
                gen.aborted = True
                gen.token_ids.extend(self._undelivered(request_id))
                await self.abort(request_id)

    def _undelivered(self, request_id: str) -> list[int]:
        """Tokens made but not yet streamed (kept when a request is aborted); most engines: none."""
        return []

    async def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The engine's own prefix-cache counters, when it exposes them. Read at each step's
        start and end; raises `EngineUnreachable` for an engine that died, which ends the run."""
        return None

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        route_key: str | None = None,
    ) -> Generation:
        """Run one request to the end and return all its token ids with timings.

        To keep partial output when cancelled, call `stream` with your own `Generation`.
        """
        gen = Generation(request_id, [], len(prompt_ids), now())
        async for _ in self.stream(
            request_id,
            prompt_ids,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            route_key=route_key,
            generation=gen,
        ):
            pass
        return gen

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
