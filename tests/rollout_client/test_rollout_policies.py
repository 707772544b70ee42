"""Policy scheduling logic, isolated: the simulated engine and a fake tool client.

These tests pin what each policy decides (who waits, when a step closes, what happens to the
unfinished); the feature tests with real servers are in test_rollout_e2e*.py.
"""

from __future__ import annotations

import pytest
from rollout_support import FakeTools, plan

from rollout_client.clock import run_virtual
from rollout_client.engines import CostModel, EventSimEngine
from rollout_client.metrics import step_metrics, summarize
from rollout_client.policies import OverlapPolicy, TurnBarrier, build_policy
from rollout_client.runner import Runner, RunnerOptions
from rollout_client.simtools import SimTools, ToolModel, _Attempt, _race
from toolenv_core.latency import HangFault

FAST = CostModel(
    prefill_per_token_s=0.0, decode_base_s=0.002, decode_per_seq_s=0.0, max_batch=64, block_size=16
)


async def run(policy: str, plans, *, batch: int, steps: int = 1, **kw):
    outcomes, _ = await run_with(FakeTools(), policy, plans, batch=batch, steps=steps, **kw)
    return outcomes


async def run_with(tools, policy: str, plans, *, batch: int, steps: int = 1, **kw):
    """The step outcomes and the engine's monitor (for `step_metrics`)."""
    engine = EventSimEngine(FAST)
    await engine.start()
    try:
        runner = Runner(
            engine, tools, build_policy(policy, **kw), RunnerOptions(batch=batch, steps=steps)
        )
        return await runner.run(iter(plans)), engine.monitor
    finally:
        await engine.close()


def straggler_plans():
    # One trajectory has one slow tool call; the others are quick, with 3 turns each.
    plans = [plan(f"t{i}", 32, [(5, 0.05), (5, 0.05), (5, None)]) for i in range(5)]
    plans.append(plan("slow", 32, [(5, 0.6), (5, 0.05), (5, None)]))
    return plans


async def test_sync_makes_every_turn_wait_for_the_slowest_tool_call() -> None:
    [sync] = await run("sync", straggler_plans(), batch=6)
    [asyn] = await run("async", straggler_plans(), batch=6)
    finish = {s.trajectory_id: s.finished_at for s in sync.done}
    # Under sync the quick trajectories cannot start turn 1 before the slow call returns.
    assert min(v for k, v in finish.items() if k != "slow") > 0.6
    assert sum(s.times.barrier_s for s in sync.states) > 5 * 0.5
    finish_async = {s.trajectory_id: s.finished_at for s in asyn.done}
    assert max(v for k, v in finish_async.items() if k != "slow") < 0.5
    assert sum(s.times.barrier_s for s in asyn.states) < 0.05
    # Same work either way: every turn produced exactly its forced length.
    for outcome in (sync, asyn):
        assert [t.completion_tokens for s in outcome.done for t in s.turns] == [5] * 18


async def test_timeout_truncates_the_slow_call_and_the_trajectory_goes_on() -> None:
    [out] = await run("async+timeout", straggler_plans(), batch=6, tool_timeout_s=0.2)
    slow = next(s for s in out.done if s.trajectory_id == "slow")
    assert slow.status == "done" and len(slow.turns) == 3
    assert [c.status for c in slow.calls] == ["timeout", "success"]
    assert slow.timeouts == 1 and sum(s.timeouts for s in out.done) == 1
    assert out.ended - out.started < 0.55


async def test_overlap_closes_at_n_and_carries_partial_rollouts_with_staleness() -> None:
    plans = [plan(f"q{i}", 16, [(4, 0.02), (4, None)]) for i in range(6)]
    plans += [plan(f"slow{i}", 16, [(4, 0.4), (6, None)]) for i in range(2)]
    # Fresh work of the second step is slower than the carried calls, so those finish there.
    plans += [plan(f"next{i}", 16, [(4, 0.8), (4, None)]) for i in range(10)]
    steps = await run("async+overlap", plans, batch=6, steps=2, over=0.34, unfinished="carry")
    first, second = steps
    assert first.launched == 9  # ceil(6 * 1.34)
    assert len(first.done) >= 6 and len(first.carried) == 9 - len(first.done)
    assert first.ended - first.started < 0.35  # did not wait for the 0.4 s calls
    carried_ids = {s.trajectory_id for s in first.carried}
    assert {"slow0", "slow1"} <= carried_ids
    resumed = [s for s in second.done if s.trajectory_id in carried_ids]
    assert resumed and all(s.staleness == 1 for s in resumed)
    for s in resumed:  # resumed where it stopped: exact lengths, no turn done twice
        assert [t.completion_tokens for t in s.turns] == [t.output_tokens for t in s.plan.turns]
    assert first.wasted_tokens == 0


async def test_overlap_abort_counts_wasted_tokens() -> None:
    plans = [plan(f"q{i}", 16, [(4, None)]) for i in range(3)] + [
        plan("slow", 16, [(20, 1.0), (4, None)])
    ]
    [out] = await run("async+overlap", plans, batch=3, over=0.34, unfinished="abort")
    assert [s.trajectory_id for s in out.aborted] == ["slow"]
    # The step closed mid-generation: the tokens the straggler had made are the waste.
    assert 0 < out.wasted_tokens == out.aborted[0].generated_tokens < 20


async def test_barrier_releases_when_a_party_leaves() -> None:
    import asyncio

    barrier = TurnBarrier()
    for _ in range(3):
        barrier.join()
    waiters = [asyncio.create_task(barrier.wait()) for _ in range(2)]
    await asyncio.sleep(0.01)
    assert not any(w.done() for w in waiters)
    barrier.leave()  # the third party finished its trajectory
    await asyncio.wait_for(asyncio.gather(*waiters), 1.0)


def test_policy_specs() -> None:
    assert build_policy("async+timeout").name == "async+timeout"
    assert build_policy("timeout").name == "async+timeout"
    assert build_policy("sync+overlap", over=0.5).launch_count(10) == 15
    with pytest.raises(ValueError, match="unknown policy"):
        build_policy("fast")
    with pytest.raises(ValueError, match="exclude"):
        build_policy("sync+async")
    with pytest.raises(ValueError):
        OverlapPolicy(over=0)


@pytest.mark.parametrize(
    ("batch", "over", "launch"),
    [(100, 0.1, 110), (50, 0.1, 55), (10, 0.3, 13), (2048, 0.1, 2253), (64, 0.25, 80)],
)
def test_over_sampling_launches_n_times_one_plus_the_ratio_rounded_up(
    batch: int, over: float, launch: int
) -> None:
    """`--batch 100 --overlap-ratio 0.1` launched 111: 100 * 1.1 is 110.00000000000001 in
    floating point, which the rounding up took for a part of a trajectory."""
    assert OverlapPolicy(over=over).launch_count(batch) == launch
    assert build_policy("async+timeout+overlap", over=over).launch_count(batch) == launch


async def test_a_failing_trajectory_is_reported_and_the_others_finish() -> None:
    from rollout_client.metrics import step_metrics

    class FailingSim(EventSimEngine):
        def _raw_stream(self, request_id, *args):
            if request_id.startswith("bad"):
                raise RuntimeError("engine said 400: token id out of vocabulary")
            return super()._raw_stream(request_id, *args)

    engine = FailingSim(FAST)
    await engine.start()
    try:
        plans = [
            plan("bad", 8, [(3, None)]),
            *(plan(f"ok{i}", 8, [(3, 0.01), (3, None)]) for i in range(3)),
        ]
        runner = Runner(engine, FakeTools(), build_policy("sync"), RunnerOptions(batch=4))
        [out] = await runner.run(iter(plans))
    finally:
        await engine.close()
    metrics = step_metrics(out, engine.monitor)
    assert (metrics["completed"], metrics["failed"]) == (3, 1)
    assert metrics["failures"] == ["RuntimeError: engine said 400: token id out of vocabulary"]


@pytest.mark.parametrize("unfinished", ["carry", "abort"])
def test_a_hung_call_the_step_closes_on_is_counted_as_left_in_flight(unfinished: str) -> None:
    """Over-sampling closes the step without the hung call: no timeout, but not 0 either."""
    plans = [plan(f"q{i}", 16, [(4, 0.05), (4, None)]) for i in range(3)]
    plans.append(plan("hung", 16, [(4, 0.05), (4, None)], tool="hangs"))
    tools = SimTools(
        {"search": ToolModel(), "hangs": ToolModel(faults=[HangFault(rate=1.0)])}, hang_s=60.0
    )

    [out], monitor = run_virtual(
        run_with(tools, "async+overlap", plans, batch=3, over=0.34, unfinished=unfinished)
    )
    metrics = step_metrics(out, monitor)
    assert out.ended - out.started < 1.0  # closed on the 3 quick ones, long before the 60 s hang
    assert [s.trajectory_id for s in out.carried + out.aborted] == ["hung"]
    assert metrics["tool_calls"] == 3 and metrics["tool_timeouts"] == 0
    assert out.abandoned_calls == metrics["tool_calls_abandoned"] == 1
    assert summarize([metrics])["tool_calls_abandoned"] == 1


def test_a_carried_call_is_made_again_with_fresh_draws_not_the_same_hang() -> None:
    """A hang is a fault of one attempt: made again in the next step, the call may answer."""
    quick = [plan(f"q{i}", 16, [(4, 0.05), (4, None)]) for i in range(40)]
    flaky = [plan(f"h{i}", 16, [(4, 0.05), (4, None)], tool="flaky") for i in range(20)]
    tools = SimTools(
        {"search": ToolModel(), "flaky": ToolModel(faults=[HangFault(rate=0.5)])}, hang_s=60.0
    )

    (first, second), _ = run_virtual(
        run_with(
            tools, "async+overlap", quick + flaky, batch=40, steps=2, over=0.5, unfinished="carry"
        )
    )
    hung = {s.trajectory_id for s in first.carried}
    assert 4 <= len(hung) <= 16  # about half of the 20 flaky calls hang on their first attempt
    # Step 1 has only the carried ones, so it waits for all of them: a hang again ends at 60 s.
    assert {s.trajectory_id for s in second.done} == hung
    hung_again = {s.trajectory_id for s in second.done if s.timeouts}
    # Each remade call draws its own fault: some answer now (with the same draw none would).
    assert 1 <= len(hung_again) <= len(hung) - 1
    assert tools.stats.faults["hang"] == len(hung) + len(hung_again)


@pytest.mark.parametrize(
    ("first", "second", "left_s", "want"),
    [
        # (status, http status, answers at) per attempt; want: (which, when)
        (("ok", 200, 0.3), ("ok", 200, 0.5), 5.0, ("first", 0.3)),
        (("error", 503, 0.3), ("ok", 200, 0.5), 5.0, ("second", 0.5)),
        (("error", 503, 0.3), ("error", 500, 0.5), 5.0, ("first", 0.5)),
        (("error", 404, 0.3), ("ok", 200, 0.5), 5.0, ("first", 0.3)),
        (("ok", 200, 0.9), ("throttle", 429, 0.1), 5.0, ("first", 0.9)),
        (("error", 503, 0.3), ("timeout", 200, float("inf")), 2.0, ("first", 1.99)),
        (("error", 503, 0.3), ("ok", 200, 0.5), float("inf"), ("first", 0.3)),
    ],
)
def test_a_hedged_call_is_decided_as_the_gateway_decides(first, second, left_s, want) -> None:
    """The simulated gateway's race mirrors `gateway.dispatch`'s: a 5xx or 429 waits for the
    other attempt (until just before the deadline; at once without one), a 4xx wins at once."""
    attempts = {
        name: _Attempt(when, status, http_status=code)
        for name, (status, code, when) in (("first", first), ("second", second))
    }
    answer, at = _race(
        (attempts["first"], attempts["first"].after_s),
        (attempts["second"], attempts["second"].after_s),
        left_s,
    )
    assert (answer is attempts[want[0]], at) == (True, pytest.approx(want[1]))
