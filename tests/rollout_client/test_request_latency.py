"""The per-request latency: fitted from a token stream's timings, and paid by the engine model."""

from __future__ import annotations

import asyncio

import pytest

from rollout_client.clock import now, run_virtual
from rollout_client.engines import CostModel, EventSimEngine

COST = CostModel(
    prefill_per_token_s=0.0,
    prefill_per_seq_s=0.002,
    decode_base_s=0.001,
    decode_per_seq_s=0.0,
    max_batch=1,
    request_latency_s=0.005,
)


def test_simulated_requests_pay_the_way_in_and_arrive_in_submission_order() -> None:
    async def main() -> list[tuple[str, float, float]]:
        engine = EventSimEngine(COST)
        await engine.start()
        gens = await asyncio.gather(
            *(
                engine.generate(f"r{i}", [1] * 8, max_tokens=2, min_tokens=2, ignore_eos=True)
                for i in range(12)
            )
        )
        return [(g.request_id, g.first_token_at or 0.0, g.finished_at or 0.0) for g in gens]

    done = run_virtual(main())
    # One slot: they run one after another, in the order they were submitted (timers due at one
    # instant fire in no set order: one asyncio.sleep each would shuffle them).
    order = [rid for rid, _, _ in sorted(done, key=lambda d: d[2])]
    assert order == [f"r{i}" for i in range(12)]
    # The first: the way in, its prefill, one decode iteration.
    assert done[0][2] == pytest.approx(0.005 + 0.002 + 0.001)


def test_a_request_aborted_on_its_way_in_never_runs() -> None:
    async def main() -> tuple[float, int]:
        engine = EventSimEngine(COST)
        await engine.start()
        task = asyncio.create_task(
            engine.generate("gone", [1] * 8, max_tokens=2, min_tokens=2, ignore_eos=True)
        )
        await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gen = await engine.generate("next", [1] * 8, max_tokens=2, min_tokens=2, ignore_eos=True)
        assert gen.finished_at == pytest.approx(now())
        return gen.finished_at - gen.submitted_at, engine.counters.iterations

    latency, iterations_run = run_virtual(main())
    assert latency == pytest.approx(0.005 + 0.002 + 0.001)
    assert iterations_run == 2  # "next" only
