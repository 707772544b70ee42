"""What a faulty or drifting profile promises, measured on the wire of a real emulator: each
fault's kind and status at its rate (within a binomial bound computed for the sample), and a
drift by call count that moves on after `calls_per_step` of the tool's calls, wherever it sits
in the profile."""

from __future__ import annotations

import asyncio
import collections

import httpx
from emu_support import FAULT, INJECTED
from scipy import stats
from testkit import ServerProcess

FAULTS = [
    {"type": "error", "rate": 0.10, "status": 503},
    {"type": "hang", "rate": 0.05},
    {"type": "throttle", "rate": 0.05, "retry_after_s": 1},
    {"type": "slow_body", "rate": 0.05, "duration_s": 0.02, "chunks": 2},
]
STATUS = {"error": 503, "hang": 504, "throttle": 429, "slow_body": 200, "none": 200}


async def test_faults_reach_the_wire_at_their_rates(client: httpx.Client, server: ServerProcess):
    model = {"kind": "faulty", "model": {"kind": "constant", "value_s": 0.0}, "faults": FAULTS}
    client.put("/v1/emulators/search/profile", json={"model": model}).raise_for_status()
    n = 1200
    seen: collections.Counter[tuple[str, int]] = collections.Counter()
    gate = asyncio.Semaphore(32)
    deadline = {"X-Toolenv-Deadline-Ms": "50"}  # what a hang lasts

    async def one(c: httpx.AsyncClient, i: int) -> None:
        async with gate:
            r = await c.post("/retrieve", json={"queries": [f"rate {i}"]}, headers=deadline)
        seen[(r.headers.get(FAULT, "none"), r.status_code)] += 1

    async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
        await asyncio.gather(*(one(c, i) for i in range(n)))
    # each kind answers its own status, and nothing else happens
    assert {kind: STATUS[kind] for kind, _ in seen} == dict(seen.keys()), seen
    rates = {f["type"]: f["rate"] for f in FAULTS}
    rates["none"] = 1 - sum(rates.values())
    for kind, rate in rates.items():
        # a count outside this interval happens once in a million runs of a right emulator
        low, high = stats.binom.interval(1 - 1e-6, n, rate)
        assert low <= seen[(kind, STATUS[kind])] <= high, (kind, seen)


def test_a_drift_by_call_count_counts_every_call_of_the_tool(client: httpx.Client) -> None:
    """Before: a drift in a mixture component counted only the calls that component drew, so
    with two halves it moved on after about twice `calls_per_step` calls (a 90% component: 11%
    late)."""
    stages = [
        {"start": 0, "model": {"kind": "constant", "value_s": 0.001}},
        {"start": 1, "model": {"kind": "constant", "value_s": 0.002}},
    ]
    drift = {"kind": "drift", "by": "step", "calls_per_step": 20, "schedule": stages}
    halves = [{"weight": 1, "model": drift}, {"weight": 1, "model": drift}]
    profile = {"model": {"kind": "mixture", "components": halves}}
    client.put("/v1/emulators/search/profile", json=profile).raise_for_status()
    delays = [
        client.post("/retrieve", json={"queries": ["d"]}).headers[INJECTED] for _ in range(40)
    ]
    assert delays == ["1.000"] * 20 + ["2.000"] * 20, delays
