"""The virtual clock and the event-driven engine model: timers, iterations, arrivals, KV-cache
preemption, the prefill budget, prefix-cache hits.

Engine timings are checked against an iteration-by-iteration sum of `CostModel.iteration_s`
written out here, the definition the closed form must agree with.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from rollout_client.clock import VirtualTimeDeadlock, now, run_virtual
from rollout_client.engines.costmodel import CostModel
from rollout_client.engines.eventsim import EventSimEngine

COST = CostModel(
    prefill_per_token_s=1e-4,
    decode_base_s=0.01,
    decode_per_seq_s=0.002,
    decode_per_ctx_token_s=1e-5,
    max_batch=8,
    block_size=16,
)


def test_virtual_clock_jumps_to_timers_and_refuses_a_wait_nothing_ends() -> None:
    async def main() -> tuple[float, float]:
        async def nap(s: float) -> float:
            await asyncio.sleep(s)
            return now()

        ends = await asyncio.gather(nap(30.0), nap(3600.0))
        return ends[0], ends[1]

    assert run_virtual(main()) == (30.0, 3600.0)

    async def stuck() -> None:
        await asyncio.Event().wait()

    with pytest.raises(VirtualTimeDeadlock):
        run_virtual(stuck())


@pytest.mark.parametrize("delay_s", [math.inf, 1e308])
def test_a_wait_past_the_horizon_is_refused_not_stepped_a_day_at_a_time(delay_s: float) -> None:
    """asyncio caps each wait at a day: a tool latency of +inf or 1e308 s stepped the virtual
    clock a day at a time for ever (a busy core, no end); past the horizon the run stops."""

    async def main() -> None:
        await asyncio.sleep(delay_s)

    with pytest.raises(VirtualTimeDeadlock, match="never ends"):
        run_virtual(main())


def reference_finish(prompts: list[int], outputs: list[int], cost: CostModel) -> list[float]:
    """Iteration by iteration: all prefilled in iteration 1 (one token each), then decode."""
    t = cost.iteration_s(0, 0, sum(prompts))
    made = [1] * len(prompts)
    finish = [t if m >= o else 0.0 for m, o in zip(made, outputs, strict=True)]
    while any(m < o for m, o in zip(made, outputs, strict=True)):
        live = [i for i in range(len(prompts)) if made[i] < outputs[i]]
        ctx = sum(prompts[i] + made[i] for i in live)
        t += cost.iteration_s(len(live), ctx, 0)
        for i in live:
            made[i] += 1
            if made[i] == outputs[i]:
                finish[i] = t
    return finish


def test_event_engine_matches_an_iteration_by_iteration_sum() -> None:
    prompts, outputs = [100, 40, 70], [50, 7, 200]

    async def main() -> list[tuple[float, int, float]]:
        engine = EventSimEngine(COST)
        await engine.start()
        gens = await asyncio.gather(
            *(
                engine.generate(f"r{i}", [1] * p, max_tokens=o)
                for i, (p, o) in enumerate(zip(prompts, outputs, strict=True))
            )
        )
        assert engine.counters.events < 10  # event to event, not 250 iterations
        return [(g.finished_at, len(g.token_ids), g.first_token_at) for g in gens]

    got = run_virtual(main())
    want = reference_finish(prompts, outputs, COST)
    assert [n for _, n, _ in got] == outputs
    assert [f for f, _, _ in got] == pytest.approx(want, rel=1e-9)
    first = COST.iteration_s(0, 0, sum(prompts))
    assert [ft for _, _, ft in got] == pytest.approx([first] * 3)


def test_an_arrival_joins_at_the_next_iteration_boundary() -> None:
    cost = CostModel(prefill_per_token_s=0, decode_base_s=1.0, decode_per_seq_s=0, max_batch=4)

    async def main() -> tuple[float, float]:
        engine = EventSimEngine(cost)
        await engine.start()
        long = asyncio.create_task(engine.generate("long", [1] * 10, max_tokens=100))
        await asyncio.sleep(10.5)  # mid-iteration 11 of the long request
        late = await engine.generate("late", [1] * 10, max_tokens=5)
        return late.first_token_at, (await long).finished_at

    first, long_end = run_virtual(main())
    # Prefill-only first iteration of "long" ends at 0 (no prefill cost); decode iterations take
    # 1 s: the late request joins at t=11, its prefill iteration also decodes "long" (1 s).
    assert first == pytest.approx(12.0)
    assert long_end == pytest.approx(99.0)


def test_kv_capacity_preempts_the_newest_and_recomputes_it() -> None:
    cost = COST.model_copy(update={"kv_capacity_tokens": 400, "max_batch": 8})

    async def main() -> tuple[list[int], EventSimEngine]:
        engine = EventSimEngine(cost)
        await engine.start()
        gens = await asyncio.gather(
            *(engine.generate(f"r{i}", [1] * 100, max_tokens=150) for i in range(3))
        )
        return [len(g.token_ids) for g in gens], engine

    lengths, engine = run_virtual(main())
    assert lengths == [150, 150, 150]  # every request still gets all its tokens
    assert engine.counters.preemptions >= 1
    assert engine.counters.recomputed_tokens > 100  # the victim's prompt and output again


def test_prefill_budget_spreads_a_burst_over_iterations() -> None:
    cost = CostModel(
        prefill_per_token_s=0.001,
        decode_base_s=0.0,
        decode_per_seq_s=0.0,
        max_batch=8,
        prefill_budget_tokens=1000,
    )

    async def main() -> list[float]:
        engine = EventSimEngine(cost)
        await engine.start()
        gens = await asyncio.gather(
            *(engine.generate(f"r{i}", [1] * 1000, max_tokens=2) for i in range(3))
        )
        return [g.first_token_at for g in gens]

    assert run_virtual(main()) == pytest.approx([1.0, 2.0, 3.0])


def test_prefix_cache_hits_whole_blocks_of_the_previous_turn_and_abort_keeps_tokens() -> None:
    async def main() -> tuple[int | None, int | None, int]:
        engine = EventSimEngine(COST)
        await engine.start()
        g1 = await engine.generate("a", [1] * 40, max_tokens=7, route_key="t")
        g2 = await engine.generate("b", [1] * 60, max_tokens=3, route_key="t")
        from rollout_client.engines.base import Generation

        gen = Generation("c", [], 10, now())
        task = asyncio.create_task(_drain(engine, gen))
        await asyncio.sleep(COST.iteration_s(1, 10, 0) * 20)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert engine.monitor.in_flight == 0
        return g1.cached_tokens, g2.cached_tokens, len(gen.token_ids)

    first, second, partial = run_virtual(main())
    assert (first, second) == (0, 32)  # 47 tokens of context: 2 whole blocks of 16
    assert 10 <= partial <= 20


async def _drain(engine: EventSimEngine, gen) -> None:
    async for _ in engine.stream("c", [1] * 10, max_tokens=10_000, generation=gen):
        pass
