"""A continuous-batching engine model that advances from event to event, not token by token.

Between two events (a sequence finishing, the KV cache filling up, a request arriving) the batch
does not change, so the time of `k` decode iterations has a closed form:

    sum_j iteration_s(B, S + B*(I0 + j), 0) = k*(base + per_seq*B + per_ctx*(S + B*I0))
                                              + per_ctx*B*k*(k-1)/2

The engine schedules one timer per event on the running loop (`loop.call_at`), so it runs on the
wall clock (live studies, `time_scale` compresses it) and on `VirtualEventLoop`'s simulated clock
alike. What it models, after vLLM's scheduler:

- `max_batch` sequences at most (waiting ones queue in arrival order);
- KV-cache capacity in tokens (`kv_capacity_tokens`): a request is admitted only if its prompt
  fits; when the running sequences grow past it, the most recently admitted one is preempted and
  later recomputed (its prompt and every token it made are prefilled again);
- a prefill token budget per iteration (`prefill_budget_tokens`, chunked prefill): a burst of
  arrivals is prefilled over several iterations, each costing `prefill_per_token_s` per token;
- prefix-cache hits by whole block: a trajectory's next turn reuses its previous prompt + output,
  floored to `block_size`, while those blocks stay cached (freed blocks are evicted oldest first
  when running sequences need the room);
- a wake-up cost on the first iteration after the engine sat idle (`idle_wake_s`);
- a cost per request that arrives while the engine is busy (`busy_arrival_s`), paid by the
  iteration after it arrived;
- a fixed latency per request outside the batch (`request_latency_s`: API, IPC, detokenizing),
  which matters for a tiny model on a CPU and not for a 7B model on a GPU. A real request pays
  part of it on the way in and part on the way out of its tokens; what a client sees (every
  timing, and what its next turn waits for) depends only on their sum, so all of it is paid on
  the way in, where it also decides which iteration the request joins. Requests reach the queue
  in the order they were submitted (a FIFO, not one timer each: timers due at the same instant
  fire in no set order).

Each request's first token lands at the end of the iteration that finished its prefill; its
tokens are delivered in one chunk when it finishes (or, for an abort, as many as it had made).
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from .base import Chunk, Engine, PrefixCacheStats
from .costmodel import CostModel

TOKEN_ID = 17  # every simulated token id (the simulator has no vocabulary; only lengths count)


@dataclass(eq=False, slots=True)
class _Seq:
    request_id: str
    prompt_len: int  # tokens held in the KV cache at admission (prompt, plus output on recompute)
    max_tokens: int
    route_key: str | None
    future: asyncio.Future[None]
    produced: int = 0  # tokens made as of iteration `joined`
    joined: int = 0  # global iteration count at which it (re)started decoding
    to_prefill: int = 0
    cached: int = 0
    first_token_at: float | None = None
    state: str = "waiting"  # inbound | waiting | prefill | running | done

    def held(self) -> int:
        """KV tokens it needs when (re)admitted: its prompt and every token it made so far."""
        return self.prompt_len + self.produced

    def made(self, iteration: int) -> int:
        return self.produced + (iteration - self.joined if self.state == "running" else 0)


@dataclass
class _Segment:
    """The iterations between two events: `k` iterations from `t0`, batch and context fixed."""

    t0: float = 0.0
    k: int = 0
    batch: int = 0
    ctx0: int = 0  # context tokens read by the first iteration
    prefill: int = 0
    prefill_seqs: int = 0  # sequences that took a prefill chunk in this (single) iteration
    joining: list[_Seq] = field(default_factory=list)  # prefills that complete in this segment
    wake: float = 0.0  # paid once, by the first iteration: waking from idle, busy arrivals


@dataclass
class EngineCounters:
    iterations: int = 0
    events: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    prefill_tokens: int = 0


class EventSimEngine(Engine):
    name = "sim"

    def __init__(self, cost: CostModel, time_scale: float = 1.0) -> None:
        super().__init__(capacity=cost.max_batch)
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.cost = cost
        self.block_size = cost.block_size
        self.time_scale = time_scale
        self.counters = EngineCounters()
        self.lag_s = 0.0  # wall clock: how late the engine's timers fired in total (CPU starved)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbound: deque[tuple[float, _Seq]] = deque()  # (arrival, seq): on their way in
        self._inbound_handle: asyncio.TimerHandle | None = None
        self._waiting: deque[_Seq] = deque()
        self._prefilling: deque[_Seq] = deque()
        self._running: dict[str, _Seq] = {}  # insertion order = admission order (LIFO preemption)
        self._ends: list[tuple[int, int, _Seq]] = []  # (iteration it finishes at, tiebreak, seq)
        self._by_id: dict[str, _Seq] = {}
        self._iteration = 0
        self._ctx_base = 0  # sum over running of (prompt_len + produced - joined)
        self._kv_prefill = 0  # KV tokens held by admitted sequences still prefilling
        self._free_cache: OrderedDict[str, int] = OrderedDict()  # route -> cached tokens, LRU
        self._free_cached = 0
        self._live_cache: dict[str, int] = {}  # route -> tokens of its finished turn still held
        self._cache = PrefixCacheStats(0.0, 0.0)
        self._seg = _Segment()
        self._handle: asyncio.TimerHandle | asyncio.Handle | None = None
        self._seg_end = -math.inf
        self._tiebreak = 0
        self._waking = False  # the engine sat idle: its next iteration pays `idle_wake_s`
        self._busy_arrivals = 0  # requests that arrived mid-segment: the next one pays for them

    # ------------------------------------------------------------------ interface

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()

    async def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._inbound_handle is not None:
            self._inbound_handle.cancel()
            self._inbound_handle = None

    async def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return PrefixCacheStats(self._cache.queries, self._cache.hits)

    async def _raw_stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        min_tokens: int,
        ignore_eos: bool,
        route_key: str | None,
    ) -> AsyncIterator[Chunk]:
        if self._loop is None:  # started lazily: a caller may hand it over unstarted
            self._loop = asyncio.get_running_loop()
        # Lengths are always forced in the simulator: there is no model to stop early.
        future = self._loop.create_future()
        seq = _Seq(request_id, len(prompt_ids), max(1, max_tokens), route_key, future)
        self._by_id[request_id] = seq
        if self.cost.request_latency_s > 0:  # the way in (and out: see the module doc)
            seq.state = "inbound"
            arrival = self._loop.time() + self.cost.request_latency_s / self.time_scale
            self._inbound.append((arrival, seq))
            if self._inbound_handle is None:
                self._inbound_handle = self._loop.call_at(arrival, self._arrive)
        else:
            self._enqueue(seq)
            self._poke()
        await future
        self._by_id.pop(request_id, None)
        yield Chunk(
            token_ids=[TOKEN_ID] * seq.produced,
            finish_reason="length",
            cached_tokens=seq.cached,
            first_token_at=seq.first_token_at,
        )

    def _undelivered(self, request_id: str) -> list[int]:
        seq = self._by_id.get(request_id)
        if seq is None or seq.state == "done":
            return []
        return [TOKEN_ID] * seq.made(self._iteration_now())

    async def abort(self, request_id: str) -> None:
        seq = self._by_id.pop(request_id, None)
        if seq is None or seq.state == "done":
            return
        if seq.state == "running":
            self._sync_to_now()
            self._remove_running(seq)
        elif seq.state == "prefill":
            self._prefilling.remove(seq)
            self._kv_prefill -= seq.held()
        elif seq.state == "waiting":
            self._waiting.remove(seq)
        seq.state = "done"  # one still inbound is dropped when it arrives
        self._poke()

    # ------------------------------------------------------------------ the model

    def _arrive(self) -> None:
        """Requests whose way in is over join the queue, in the order they were submitted."""
        assert self._loop is not None
        self._inbound_handle = None
        now = self._loop.time()
        arrived = False
        while self._inbound and self._inbound[0][0] <= now:
            _, seq = self._inbound.popleft()
            if seq.state == "inbound":  # not aborted on the way
                seq.state = "waiting"
                self._enqueue(seq)
                arrived = True
        if self._inbound:
            self._inbound_handle = self._loop.call_at(self._inbound[0][0], self._arrive)
        if arrived:
            self._poke()

    def _enqueue(self, seq: _Seq) -> None:
        """A request reaches the queue; if the engine is running (not idle, not about to wake),
        its next iteration pays for taking it in."""
        self._waiting.append(seq)
        if self._handle is not None and not self._waking:
            self._busy_arrivals += 1

    def _iteration_s(self, batch: int, ctx: int, prefill: int, prefill_seqs: int) -> float:
        return self.cost.iteration_s(batch, ctx, prefill, prefill_seqs) / self.time_scale

    def _segment_s(self, seg: _Segment, k: int) -> float:
        """Seconds for the first `k` iterations of `seg` (closed form, see the module doc)."""
        if seg.batch == 0:
            return k * self._iteration_s(0, 0, seg.prefill, seg.prefill_seqs) + seg.wake
        c = self.cost
        per = (
            c.decode_base_s
            + c.decode_per_seq_s * seg.batch
            + c.decode_per_ctx_token_s * seg.ctx0
            + c.prefill_per_token_s * seg.prefill
            + c.prefill_per_seq_s * seg.prefill_seqs
        )
        grow = c.decode_per_ctx_token_s * seg.batch * k * (k - 1) / 2
        return (k * per + grow) / self.time_scale + seg.wake

    def _elapsed_iterations(self, t: float) -> int:
        """Whole iterations of the current segment finished by time `t` (0 .. k-1)."""
        seg = self._seg
        dt = t - seg.t0
        if dt <= 0 or seg.k <= 1:
            return 0
        one = self._segment_s(seg, 1)
        if one <= 0:
            return seg.k - 1
        m = int(dt / one)  # an upper bound: iterations only get longer as the context grows
        m = min(m, seg.k - 1)
        lo, hi = 0, m
        while lo < hi:  # the largest m with segment_s(m) <= dt
            mid = (lo + hi + 1) // 2
            if self._segment_s(seg, mid) <= dt:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _iteration_now(self) -> int:
        if self._loop is None or self._seg.k == 0:
            return self._iteration
        return self._iteration + self._elapsed_iterations(self._loop.time())

    def _sync_to_now(self) -> None:
        """Cut the current segment at the iteration boundary now falls in, and apply what ran."""
        assert self._loop is not None
        seg = self._seg
        if seg.k <= 1 or self._loop.time() >= self._seg_end:
            return
        m = self._elapsed_iterations(self._loop.time())
        if m == 0:
            return
        # The first m iterations ran as planned; the segment resumes from there.
        self._iteration += m
        self.counters.iterations += m
        seg.t0 += self._segment_s(seg, m)
        seg.ctx0 += seg.batch * m
        seg.k -= m

    def _poke(self) -> None:
        """Something changed: end the current segment at its next iteration boundary."""
        assert self._loop is not None
        now = self._loop.time()
        if self._handle is None:
            self._seg = _Segment(t0=now)
            self._seg_end = now
            self._waking = True
            self._handle = self._loop.call_soon(self._tick)
            return
        seg = self._seg
        if seg.k <= 1 or now >= self._seg_end:
            return
        k = self._elapsed_iterations(now) + 1
        if k >= seg.k:
            return
        seg.k = k
        self._seg_end = seg.t0 + self._segment_s(seg, k)
        self._handle.cancel()
        self._handle = self._loop.call_at(self._seg_end, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        self._handle = None
        now = self._loop.time()
        if now > self._seg_end:  # a timer that fired late: the host fell behind
            # Every late wake-up counts: the next segment starts from it, so the lateness adds
            # up in the modelled times. Counting those over 5 ms alone missed 1-4 ms ones at
            # --time-scale 20, which had made a step 12% longer with no note.
            self.lag_s += now - self._seg_end
        self.counters.events += 1
        seg = self._seg
        self._iteration += seg.k
        self.counters.iterations += seg.k
        for seq in seg.joining:  # prefill done: the first token came out of that iteration
            if seq.state != "prefill":
                continue  # aborted meanwhile
            self._prefilling.remove(seq)
            self._kv_prefill -= seq.held()
            seq.produced += 1
            seq.state, seq.joined, seq.first_token_at = "running", self._iteration, now
            self._running[seq.request_id] = seq
            self._ctx_base += seq.prompt_len + seq.produced - seq.joined
            end = self._iteration + seq.max_tokens - seq.produced
            heapq.heappush(self._ends, (end, self._tiebreak, seq))
            self._tiebreak += 1
        while self._ends and self._ends[0][0] <= self._iteration:
            _, _, seq = heapq.heappop(self._ends)
            if seq.state == "running" and seq.made(self._iteration) >= seq.max_tokens:
                self._remove_running(seq)
                seq.state = "done"
                if seq.route_key:
                    self._retain(seq.route_key, seq.held())
                seq.future.set_result(None)
        self._preempt_if_full()
        self._admit()
        self._plan(now)

    def _remove_running(self, seq: _Seq) -> None:
        """Take a sequence out of the batch, bringing its token count up to this iteration."""
        del self._running[seq.request_id]
        self._ctx_base -= seq.prompt_len + seq.produced - seq.joined
        seq.produced = seq.made(self._iteration)
        seq.joined = self._iteration

    def _kv_used(self) -> int:
        return self._ctx_base + len(self._running) * self._iteration + self._kv_prefill

    def _retain(self, route: str, tokens: int) -> None:
        """A finished turn's blocks stay cached (until evicted) for that trajectory's next turn."""
        block = self.cost.block_size
        kept = (tokens // block) * block
        old = self._free_cache.pop(route, 0)
        self._free_cached += kept - old
        self._free_cache[route] = kept

    def _evict(self, need: int) -> None:
        """Free cached blocks, oldest first, until `need` more tokens fit beside the live ones."""
        cap = self.cost.kv_capacity_tokens
        if cap is None:
            return
        while self._free_cache and self._kv_used() + self._free_cached + need > cap:
            _, tokens = self._free_cache.popitem(last=False)
            self._free_cached -= tokens

    def _preempt_if_full(self) -> None:
        cap = self.cost.kv_capacity_tokens
        if cap is None:
            return
        self._evict(0)
        while len(self._running) > 1 and self._kv_used() > cap:
            victim = self._running[next(reversed(self._running))]
            self._remove_running(victim)
            # Recompute: the prompt and every token made so far are prefilled again on return.
            victim.state = "waiting"
            self.counters.preemptions += 1
            self.counters.recomputed_tokens += victim.held()
            self._waiting.appendleft(victim)

    def _admit(self) -> None:
        cap = self.cost.kv_capacity_tokens
        block = self.cost.block_size
        while self._waiting and len(self._running) + len(self._prefilling) < self.cost.max_batch:
            seq = self._waiting[0]
            need = seq.held()
            self._evict(need)
            busy = self._running or self._prefilling
            if cap is not None and busy and self._kv_used() + need > cap:
                break
            self._waiting.popleft()
            hit = 0
            if seq.route_key is not None and seq.route_key in self._free_cache:
                hit = self._free_cache.pop(seq.route_key)
                self._free_cached -= hit
                hit = min(hit, ((need - 1) // block) * block)
            seq.cached = hit
            self._cache.queries += need
            self._cache.hits += hit
            seq.to_prefill = need - hit
            seq.state = "prefill"
            self._kv_prefill += need
            self._prefilling.append(seq)

    def _plan(self, now: float) -> None:
        """Schedule the next event: one prefill iteration, or decode up to the next event."""
        assert self._loop is not None
        budget = self.cost.prefill_budget_tokens
        chunk = seqs = 0
        joining: list[_Seq] = []
        for seq in self._prefilling:
            if budget <= 0:
                break
            take = min(seq.to_prefill, budget)
            seq.to_prefill -= take
            budget -= take
            chunk += take
            seqs += 1
            if seq.to_prefill == 0:
                joining.append(seq)
        batch = len(self._running)
        ctx0 = self._ctx_base + batch * self._iteration
        if chunk or joining:
            k = 1
        elif batch:
            while self._ends and self._ends[0][2].state != "running":
                heapq.heappop(self._ends)
            k = max(1, self._ends[0][0] - self._iteration) if self._ends else 1
            cap = self.cost.kv_capacity_tokens
            if cap is not None:
                k = min(k, max(1, (cap - self._kv_used()) // batch))
        else:
            self._seg = _Segment(t0=now)
            self._seg_end = now
            self._busy_arrivals = 0
            return
        self.counters.prefill_tokens += chunk
        self._seg = _Segment(now, k, batch, ctx0, chunk, seqs, joining=joining)
        if self._waking:  # the first iteration after idling: k is 1 (nothing runs, it prefills)
            self._seg.wake, self._waking = self.cost.idle_wake_s / self.time_scale, False
        if self._busy_arrivals:
            self._seg.wake += self.cost.busy_arrival_s * self._busy_arrivals / self.time_scale
            self._busy_arrivals = 0
        self._seg_end = now + self._segment_s(self._seg, k)
        self._handle = self._loop.call_at(self._seg_end, self._tick)
