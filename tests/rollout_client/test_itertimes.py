"""The engine model's wake-up cost, and iterations read back from a token stream's timings."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rollout_client.clock import now, run_virtual
from rollout_client.engines import CostModel, EventSimEngine
from rollout_client.itertimes import (
    ARRIVALS,
    DURATION,
    WAKE,
    RequestLog,
    StreamLog,
    fit_iterations,
    iterations,
)

COST = CostModel(
    prefill_per_token_s=0.0,
    prefill_per_seq_s=0.002,
    decode_base_s=0.001,
    decode_per_seq_s=0.0,
    idle_wake_s=0.01,
    max_batch=8,
)


def test_waking_from_idle_costs_once_per_idle_period() -> None:
    async def main() -> list[float]:
        engine = EventSimEngine(COST)
        await engine.start()
        one = await engine.generate("a", [1] * 8, max_tokens=3, min_tokens=3, ignore_eos=True)
        a, b = await asyncio.gather(
            engine.generate("b", [1] * 8, max_tokens=3, min_tokens=3, ignore_eos=True),
            engine.generate("c", [1] * 8, max_tokens=3, min_tokens=3, ignore_eos=True),
        )
        return [g.finished_at - g.submitted_at for g in (one, a, b)]

    alone, b, c = run_virtual(main())
    # Idle engine: wake + prefill (one sequence) + 2 decode iterations.
    assert alone == pytest.approx(0.01 + 0.002 + 2 * 0.001)
    # Two arrivals together: one wake, one prefill iteration of two sequences.
    assert b == c == pytest.approx(0.01 + 2 * 0.002 + 2 * 0.001)


def test_iterations_are_rebuilt_from_chunk_arrivals() -> None:
    # Two requests submitted at 0: a prefill iteration ends at 0.010 (both first tokens), decode
    # iterations at 0.012 and 0.014; then idle, and a third request at 0.050 (cached 32 of 64).
    logs = {
        "a": RequestLog(0.0, 100, 0, [(0.0100, 1), (0.0120, 1), (0.0140, 1)]),
        "b": RequestLog(0.0, 50, 0, [(0.0101, 1), (0.0121, 1)]),
        "c": RequestLog(0.050, 64, 32, [(0.060, 1), (0.0615, 1)]),
    }
    rows = iterations(logs)
    assert rows[:, DURATION] == pytest.approx([0.0101, 0.002, 0.0019, 0.010, 0.0015], abs=1e-6)
    assert rows[:, 1].tolist() == [0, 2, 1, 0, 1]  # decoding sequences
    assert rows[:, 2].tolist() == [0, 152, 102, 0, 65]  # their context (prompt + made so far)
    assert rows[:, 3].tolist() == [150, 0, 0, 32, 0]  # prompt tokens prefilled (minus cached)
    assert rows[:, 4].tolist() == [2, 0, 0, 1, 0]  # sequences prefilled
    assert rows[:, WAKE].tolist() == [1, 0, 0, 1, 0]  # after idle
    assert rows[:, ARRIVALS].tolist() == [0, 0, 0, 0, 0]  # b came with a, c to an idle engine


def test_a_request_submitted_while_an_iteration_ran_is_counted_as_its_arrival() -> None:
    # a runs from 0; d is submitted at 0.011, during the iteration (0.010, 0.012], and is
    # prefilled in the next one.
    logs = {
        "a": RequestLog(0.0, 10, 0, [(0.010, 1), (0.012, 1), (0.014, 1), (0.016, 1)]),
        "d": RequestLog(0.011, 10, 0, [(0.0141, 1), (0.0161, 1)]),
    }
    assert iterations(logs)[:, ARRIVALS].tolist() == [0, 1, 0, 0]


def test_a_request_arriving_at_a_busy_engine_costs_its_next_iteration() -> None:
    def finish_of_a(arrival_s: float) -> float:
        async def main() -> float:
            engine = EventSimEngine(COST.model_copy(update={"busy_arrival_s": arrival_s}))
            await engine.start()
            a = asyncio.create_task(
                engine.generate("a", [1] * 8, max_tokens=20, min_tokens=20, ignore_eos=True)
            )
            await asyncio.sleep(0.0155)  # mid-way through a's decode iterations
            await engine.generate("b", [1] * 8, max_tokens=2, min_tokens=2, ignore_eos=True)
            return (await a).finished_at

        return run_virtual(main())

    assert finish_of_a(0.003) - finish_of_a(0.0) == pytest.approx(0.003)


def test_requests_submitted_together_to_an_idle_engine_pay_no_arrival_cost() -> None:
    async def main() -> list[float]:
        engine = EventSimEngine(COST.model_copy(update={"busy_arrival_s": 0.003}))
        await engine.start()
        gens = await asyncio.gather(
            *(
                engine.generate(k, [1] * 8, max_tokens=3, min_tokens=3, ignore_eos=True)
                for k in "abc"
            )
        )
        return [g.finished_at - g.submitted_at for g in gens]

    # One wake, one prefill iteration of three sequences, two decode iterations.
    assert run_virtual(main()) == pytest.approx([0.01 + 3 * 0.002 + 2 * 0.001] * 3)


TRUTH = dict(
    decode_base_s=0.0015,
    decode_per_seq_s=6e-5,
    decode_per_ctx_token_s=2e-7,
    prefill_per_token_s=1.5e-5,
    prefill_per_seq_s=3e-4,
    idle_wake_s=0.011,
    busy_arrival_s=4e-4,
)
START = CostModel(prefill_per_token_s=0, decode_base_s=0, decode_per_seq_s=0)


def synthetic_run(rng: np.random.Generator, n: int, speed: float = 1.0) -> np.ndarray:
    """`n` iterations of the formula with TRUTH's costs, all `speed` times slower, 1% noise."""
    decoding = rng.integers(0, 16, n)
    context = decoding * rng.integers(50, 400, n)
    fresh = rng.integers(0, 3, n) * (rng.random(n) < 0.4)
    prefill = fresh * rng.integers(20, 300, n)
    wake = (np.arange(n) % 20 == 0).astype(int)  # every run wakes as often (5%), from its start
    fresh[0], prefill[0], decoding[0], context[0] = 2, 200, 0, 0
    noise = speed * rng.normal(1, 0.01, n)
    arrivals = rng.integers(1, 3, n) * (rng.random(n) < 0.3) * (wake == 0)
    t = TRUTH
    duration = (
        (decoding > 0) * t["decode_base_s"]
        + decoding * t["decode_per_seq_s"]
        + context * t["decode_per_ctx_token_s"]
        + prefill * t["prefill_per_token_s"]
        + fresh * t["prefill_per_seq_s"]
        + wake * t["idle_wake_s"]
        + arrivals * t["busy_arrival_s"]
    ) * noise
    return np.c_[duration, decoding, context, prefill, fresh, wake, arrivals].astype(float)


def test_fit_recovers_the_formula_from_iterations() -> None:
    rng = np.random.default_rng(0)
    runs = [synthetic_run(rng, 100) for _ in range(4)]
    fitted = fit_iterations(runs, START)
    for key, value in TRUTH.items():
        assert getattr(fitted, key) == pytest.approx(value, rel=0.2), key
    assert fitted.fit_error["workload_iterations"] == 400
    with pytest.raises(ValueError, match="too few"):
        fit_iterations([runs[0][:3]], fitted)


def test_fit_takes_the_median_run_and_ignores_a_stalled_wake_up() -> None:
    # Five runs, two of them 1.5x slower throughout (a loaded machine), and one wake-up that
    # stalled for 270 ms: the model is the typical run's, and the wake-up cost stays ~11 ms.
    # (A pooled least-squares fit put every cost ~20% high and the wake-up near 20 ms.)
    rng = np.random.default_rng(1)
    runs = [synthetic_run(rng, 120, speed) for speed in (1.0, 1.5, 1.0, 1.5, 1.0)]
    runs[2][0, DURATION] += 0.27
    fitted = fit_iterations(runs, START)
    for key, value in TRUTH.items():
        assert getattr(fitted, key) == pytest.approx(value, rel=0.1), key
    assert fitted.fit_error["workload_run_slowdown_max"] == pytest.approx(1.5, rel=0.05)


def test_wake_up_is_fitted_apart_from_the_prefill_it_wakes_for() -> None:
    # Every wake-up prefills many sequences: fitted jointly, wake and per-sequence prefill can
    # trade off; the busy iterations pin the prefill, the wake-up takes only what is left.
    rng = np.random.default_rng(2)
    runs = []
    for _ in range(5):
        run = synthetic_run(rng, 150)
        woke = run[:, WAKE] == 1
        extra = 12 - run[woke, 4]  # 12 more sequences prefilled on each wake-up ...
        run[woke, 4] += extra
        run[woke, DURATION] += extra * TRUTH["prefill_per_seq_s"]
        run[woke, DURATION] += rng.normal(0, 0.003, woke.sum())  # ... and noisy wake-ups
        runs.append(run)
    fitted = fit_iterations(runs, START)
    assert fitted.idle_wake_s == pytest.approx(TRUTH["idle_wake_s"], rel=0.15)
    assert fitted.prefill_per_seq_s == pytest.approx(TRUTH["prefill_per_seq_s"], rel=0.2)


def test_stream_log_keeps_every_chunk_of_the_engine_it_wraps() -> None:
    async def main() -> StreamLog:
        engine = StreamLog(EventSimEngine(COST))
        await engine.start()
        await engine.generate("x", [1] * 40, max_tokens=4, min_tokens=4, ignore_eos=True)
        assert now() > 0
        return engine

    logged = run_virtual(main())
    log = logged.requests["x"]
    assert (log.submitted, log.prompt_len) == (0.0, 40)
    assert sum(n for _, n in log.chunks) == 4  # the simulator hands its tokens over in one chunk
