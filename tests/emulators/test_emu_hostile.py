"""Hostile input a new user can send over HTTP: a 4xx naming the field, never a 500."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from emu_support import FAST

from emulators.reward import RewardEmulator
from emulators.settings import EmulatorSettings
from toolenv_core.latency.profile import Profile


@pytest.mark.parametrize(
    ("tool", "key", "value"),
    [("reward", "batch_size", 0), ("reward", "batch_size", -64), ("search", "topk", 0)],
)
def test_a_profile_reference_must_be_positive(
    client: httpx.Client, tool: str, key: str, value: float
) -> None:
    # a reference of 0 was accepted and every later call was a 500 (a division by it); a negative
    # one answered a negative reward_time_s
    profile = {**FAST, "reference": {key: value}}
    r = client.put(f"/v1/emulators/{tool}/profile", json=profile)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "reference", key]
    call = {"batch_size": 3} if tool == "reward" else {"query": "q"}
    assert client.post(f"/v1/emulators/{tool}/call", json=call).status_code == 200


@pytest.mark.parametrize(
    ("lengths", "loc"),
    [
        ([10**400], ["body", "response_lengths", 0]),  # their mean overflowed a float: a 500
        ([1] * 100_001, ["body", "response_lengths"]),  # more responses than batch_size allows
    ],
)
def test_reward_response_lengths_are_bounded(
    client: httpx.Client, lengths: list[int], loc: list
) -> None:
    r = client.post("/v1/emulators/reward/call", json={"response_lengths": lengths})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == loc


@pytest.mark.parametrize("value", [1e300, 3e6])
def test_a_drawn_response_size_is_capped_at_max_response_tokens(
    client: httpx.Client, value: float
) -> None:
    # a profile's response_tokens was not bounded: 1e300 was a 500, 3e6 a 20 MB response per query
    profile = {**FAST, "response_tokens": {"kind": "constant", "value_s": value}}
    assert client.put("/v1/emulators/search/profile", json=profile).status_code == 200
    r = client.post("/retrieve", json={"queries": ["q"]})
    assert r.status_code == 200, r.text
    assert sum(len(d["contents"].split()) for d in r.json()["result"][0]) == 200_000


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/retrieve", b'{"queries": ["who wrote \\ud800"]}'),
        ("/v1/emulators/search/call", b'{"query": "\\udfff", "delay_s": 0}'),
    ],
)
def test_a_query_with_a_lone_surrogate_is_answered(
    client: httpx.Client, path: str, body: bytes
) -> None:
    # JSON can escape a lone surrogate, which strict UTF-8 cannot encode: seeding its documents
    # was a 500
    assert client.put("/v1/emulators/search/profile", json=FAST).status_code == 200
    r = client.post(path, content=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["result"][0]) == 3


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        (b'{"model": {"kind": "constant", "value_s": 0}, "source": "\\ud800"}', ["source"]),
        (b'{"model": {"kind": "constant", "value_s": 0}, "fit": {"\\udfff": 1}}', ["fit"]),
    ],
)
def test_a_profile_string_must_be_text(client: httpx.Client, body: bytes, loc: list) -> None:
    # accepted, after which GET .../profile and GET /v1/emulators were a 500 until the next PUT
    r = client.put("/v1/emulators/reward/profile", content=body)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", *loc]
    assert client.get("/v1/emulators/reward/profile").status_code == 200
    assert client.get("/v1/emulators").status_code == 200


def test_a_fractional_reference_batch_is_a_batch_of_at_least_one(client: httpx.Client) -> None:
    # a call without batch_size takes the profile's reference batch: 0.5 was truncated to 0
    profile = {**FAST, "reference": {"batch_size": 0.5}}
    assert client.put("/v1/emulators/reward/profile", json=profile).status_code == 200
    r = client.post("/v1/emulators/reward/call", json={})
    assert r.status_code == 200, r.text
    assert r.json()["batch_size"] == 1


def test_probes_answer_head(client: httpx.Client) -> None:
    # load balancers' health checks send HEAD: it was a 405
    for probe in ("/healthz", "/readyz"):
        r = client.head(probe)
        assert r.status_code == 200 and r.content == b""


@pytest.mark.parametrize("tool", ["search", "reward"])
def test_a_body_step_is_a_64_bit_count_like_x_step(client: httpx.Client, tool: str) -> None:
    # under a drift profile a body `step` past the float range was a 500 (float(step) overflowed);
    # X-Step was already capped at a 64-bit count, the body's step was not
    drift = {
        "tool": tool,
        "model": {
            "kind": "drift",
            "schedule": [
                {"start": 0, "model": {"kind": "constant", "value_s": 0}},
                {"start": 5, "model": {"kind": "constant", "value_s": 0}},
            ],
        },
    }
    assert client.put(f"/v1/emulators/{tool}/profile", json=drift).status_code == 200
    call = b'{"query": "q", ' if tool == "search" else b'{"batch_size": 1, '
    huge = call + b'"step": 1' + b"0" * 309 + b"}"
    r = client.post(f"/v1/emulators/{tool}/call", content=huge)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "step"]
    top = call + f'"step": {2**63 - 1}}}'.encode()
    assert client.post(f"/v1/emulators/{tool}/call", content=top).status_code == 200


def _strict_json(text: str) -> object:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_reward_scale_past_the_float_range_is_still_json(client: httpx.Client) -> None:
    # a tiny reference batch made the scale inf: the reply said `"scale":Infinity`, which no
    # strict JSON parser reads
    profile = {"tool": "reward", **FAST, "reference": {"batch_size": 1e-308}}
    assert client.put("/v1/emulators/reward/profile", json=profile).status_code == 200
    r = client.post("/v1/emulators/reward/call", json={"batch_size": 100_000, "delay_s": 0})
    assert r.status_code == 200, r.text
    body = _strict_json(r.text)
    assert body["scale"] > 1e300 and body["reward_time_s"] == 0.0


def test_a_length_scaling_past_the_float_range_is_no_overflow() -> None:
    # (mean / reference mean) ** exponent raised OverflowError: every such call was a 500
    settings = EmulatorSettings(reward_length_exponent=2.0)
    profile = Profile.model_validate(
        {"tool": "reward", **FAST, "reference": {"response_mean": 1e-300}}
    )
    scale = RewardEmulator(settings, profile).scale(64, 1e9)
    assert 1e300 < scale < float("inf")


def test_an_exact_replay_is_counted_as_a_call(client: httpx.Client) -> None:
    # `GET /v1/emulators` counted sampled calls only: a replay of delay_s calls said `calls: 0`
    def calls() -> dict[str, int]:
        listed = client.get("/v1/emulators").json()["tools"]
        return {t["tool"]: t["calls"] for t in listed}

    before = calls()
    assert client.post("/v1/emulators/search/call", json={"query": "q", "delay_s": 0}).is_success
    assert client.post("/v1/emulators/reward/call", json={"batch_size": 1, "delay_s": 0}).is_success
    assert calls() == {"search": before["search"] + 1, "reward": before["reward"] + 1}


async def test_the_biggest_retrieve_does_not_hold_up_other_calls(client: httpx.Client) -> None:
    # 256 queries at topk 50 (the largest request the defaults allow) rendered its documents on
    # the event loop, about a second in which every other call's reply waited
    assert client.put("/v1/emulators/search/profile", json=FAST).status_code == 200
    heavy = {"queries": [f"heavy {i}" for i in range(256)], "topk": 50}
    async with httpx.AsyncClient(base_url=str(client.base_url), timeout=30) as c:

        async def timed(body: dict, after_s: float) -> float:
            await asyncio.sleep(after_s)
            started = time.monotonic()
            r = await c.post("/retrieve", json=body)
            assert r.status_code == 200, r.text
            return time.monotonic() - started

        heavy_s, light_s = await asyncio.gather(
            timed(heavy, 0.0), timed({"queries": ["light"], "topk": 1}, 0.1)
        )
    assert light_s < heavy_s / 3, (light_s, heavy_s)


@pytest.mark.parametrize(
    "sizes",
    [
        {"kind": "trace", "values_s": [100, 200, 300]},
        {"kind": "faulty", "model": {"kind": "constant", "value_s": 90}, "faults": []},
        {
            "kind": "mixture",
            "components": [
                {"weight": 1, "model": {"kind": "constant", "value_s": 90}},
                {
                    "weight": 1,
                    "model": {
                        "kind": "drift",
                        "schedule": [{"start": 0, "model": {"kind": "constant", "value_s": 9}}],
                    },
                },
            ],
        },
    ],
)
def test_response_sizes_that_depend_on_call_order_are_refused(
    client: httpx.Client, sizes: dict
) -> None:
    # each query's size is drawn from a sampler made for it: a `trace` of sizes was accepted and
    # answered its first value (100) to every query, a drift its first stage
    r = client.put("/v1/emulators/search/profile", json={**FAST, "response_tokens": sizes})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "response_tokens"]
    kind = "drift" if sizes["kind"] == "mixture" else sizes["kind"]  # the one inside it
    assert f"a {kind!r} model cannot size responses" in r.json()["detail"][0]["msg"]
    table = {"kind": "empirical", "samples": [100, 200, 300]}
    ok = client.put("/v1/emulators/search/profile", json={**FAST, "response_tokens": table})
    assert ok.status_code == 200, ok.text
