"""A simulated continuous-batching engine that runs in real time from a cost model.

It behaves like vLLM's scheduler at iteration granularity: requests wait until a batch slot is
free (`max_batch`), are prefilled in the iteration they join (minus the prefix-cache hit of the
same trajectory's previous turn, in whole blocks), then get one token per iteration; each
iteration lasts `CostModel.iteration_s(...) / time_scale` seconds of wall time. Studies then run at
PolyTrace scale on a CPU, and the tool calls they interleave with are real HTTP calls.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from .base import Chunk, Engine, PrefixCacheStats
from .costmodel import CostModel

# Consumers are woken on the first token, then every CHUNK tokens and at the end: waking every
# trajectory's task on every iteration would cost more CPU than the simulated engine itself.
CHUNK = 8


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_len: int
    max_tokens: int
    route_key: str | None
    seed: int
    produced: int = 0
    delivered: int = 0
    event: asyncio.Event = field(default_factory=asyncio.Event)
    done: bool = False
    cached: int = 0


class SimEngine(Engine):
    name = "sim"

    def __init__(self, cost: CostModel, time_scale: float = 1.0, vocab_size: int = 1024) -> None:
        super().__init__(capacity=cost.max_batch)
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.cost = cost
        self.block_size = cost.block_size
        self.time_scale = time_scale
        self.vocab_size = vocab_size
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._by_id: dict[str, _Request] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_len: dict[str, int] = {}
        self._cache = PrefixCacheStats(0.0, 0.0)
        self.iterations = 0
        self._context = (
            0  # tokens of every running sequence (prompt + produced), kept incrementally
        )
        self.lag_s = 0.0  # wall time the simulation fell behind its cost model (CPU starvation)
        self.batch_samples: list[tuple[float, int]] = []

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="sim-engine")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _raw_stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        min_tokens: int,
        ignore_eos: bool,
        route_key: str | None,
    ) -> AsyncIterator[Chunk]:
        if self._task is None:
            raise RuntimeError("SimEngine.start() was not called")
        # Lengths are always forced in the simulator: there is no model to stop early.
        req = _Request(
            request_id,
            len(prompt_ids),
            max_tokens,
            route_key,
            seed=zlib.crc32(request_id.encode()) & 0xFFFF,
        )
        self._by_id[request_id] = req
        self._waiting.append(req)
        self._wake.set()
        first = True
        while True:
            await req.event.wait()
            req.event.clear()
            ids = self._take(req)
            if ids or req.done:
                yield Chunk(
                    token_ids=ids,
                    finish_reason="length" if req.done else None,
                    cached_tokens=req.cached if first else None,
                )
                first = False
            if req.done:
                self._by_id.pop(request_id, None)
                return

    def _take(self, req: _Request) -> list[int]:
        """The tokens made since the last delivery (ids are a function of seed and position)."""
        ids = [(req.seed + i * 7919) % self.vocab_size for i in range(req.delivered, req.produced)]
        req.delivered = req.produced
        return ids

    def _undelivered(self, request_id: str) -> list[int]:
        req = self._by_id.get(request_id)
        return self._take(req) if req is not None else []

    async def abort(self, request_id: str) -> None:
        req = self._by_id.pop(request_id, None)
        if req is None:
            return
        if req in self._running:
            self._running.remove(req)
            self._context -= req.prompt_len + req.produced
        elif req in self._waiting:
            self._waiting.remove(req)
        req.done = True

    async def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return PrefixCacheStats(self._cache.queries, self._cache.hits)

    def _admit(self) -> int:
        """Move waiting requests into the batch; return the tokens to prefill this iteration."""
        prefill = 0
        block = self.cost.block_size
        while self._waiting and len(self._running) < self.cost.max_batch:
            req = self._waiting.popleft()
            previous = self._last_len.get(req.route_key, 0) if req.route_key else 0
            req.cached = (min(previous, req.prompt_len - 1) // block) * block if previous else 0
            self._cache.queries += req.prompt_len
            self._cache.hits += req.cached
            prefill += req.prompt_len - req.cached
            self._context += req.prompt_len
            self._running.append(req)
        return prefill

    async def _loop(self) -> None:
        clock = time.monotonic()
        while True:
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                clock = time.monotonic()
            prefill = self._admit()
            batch = len(self._running)
            context = self._context
            duration = self.cost.iteration_s(batch, context, prefill) / self.time_scale
            target, floor = clock + duration, time.monotonic() - 0.05
            if target < floor:  # starved of CPU: catch up at most 50 ms, record the rest as lag
                self.lag_s += floor - target
            clock = max(target, floor)
            self.batch_samples.append((time.monotonic(), batch))
            delay = clock - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)
            self.iterations += 1
            still: list[_Request] = []
            for req in self._running:
                req.produced += 1
                if req.produced >= req.max_tokens:
                    req.done = True
                    self._context -= req.prompt_len + req.produced - 1
                    if req.route_key:
                        self._last_len[req.route_key] = req.prompt_len + req.produced
                    req.event.set()
                    continue
                still.append(req)
                if req.produced == 1 or req.produced % CHUNK == 0:
                    req.event.set()
            self._context += len(still)
            self._running = still
