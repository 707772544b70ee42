"""Latency profiles on a real emulator server: swaps, listing, validation, drift by step, profiles from files and options."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from emu_support import FAST, INJECTED, start_server
from testkit import free_port

from toolenv_core.latency.profile import shipped_profile_path


def test_profile_swap_list_and_validation(client: httpx.Client) -> None:
    put = client.put(
        "/v1/emulators/search/profile",
        json={"model": {"kind": "constant", "value_s": 0.05}, "source": "test"},
    )
    assert put.status_code == 200 and put.json()["kind"] == "constant"
    assert client.get("/v1/emulators/search/profile").json()["model"] == {
        "kind": "constant",
        "value_s": 0.05,
    }
    assert client.post("/retrieve", json={"queries": ["q"]}).headers[INJECTED] == "50.000"
    tools = {t["tool"]: t for t in client.get("/v1/emulators").json()["tools"]}
    assert set(tools) == {"search", "reward"} and tools["search"]["kind"] == "constant"
    bad = client.put(
        "/v1/emulators/search/profile", json={"model": {"kind": "gamma", "shape": -1, "scale_s": 1}}
    )
    assert bad.status_code == 422
    assert bad.json()["detail"][0]["loc"] == ["body", "model", "gamma", "shape"]
    assert "shape" in bad.json()["message"]
    assert (
        client.get("/v1/emulators/search/profile").json()["model"]["kind"] == "constant"
    )  # unchanged
    wrong_tool = client.put(
        "/v1/emulators/search/profile",
        json={"tool": "reward", "model": {"kind": "constant", "value_s": 1}},
    )
    assert wrong_tool.status_code == 422 and wrong_tool.json()["detail"][0]["loc"] == [
        "body",
        "tool",
    ]
    unreadable = client.put(
        "/v1/emulators/search/profile",
        json={"model": {"kind": "trace", "paths": ["/nonexistent.jsonl"]}},
    )
    assert unreadable.status_code == 422 and "nonexistent" in unreadable.text
    for bad in (b"{nope", b"[" * 100_000 + b"]" * 100_000):  # too deep: a 500 before
        malformed = client.put("/v1/emulators/search/profile", content=bad)
        assert malformed.status_code == 400
        assert malformed.json() == {"detail": "request body is not valid JSON"}
    assert client.get("/v1/emulators/nope/profile").status_code == 404
    assert client.put("/v1/emulators/nope/profile", json=FAST).status_code == 404


@pytest.mark.parametrize(
    ("raw", "loc"),
    [
        (b'{"model": {"kind": "lognormal", "median_s": Infinity, "sigma": 1}}',
         ["body", "model", "lognormal", "median_s"]),
        (b'{"model": {"kind": "empirical", "quantiles": [[0, 0.1], [0.5, NaN], [1, 2]]}}',
         ["body", "model", "empirical", "quantiles", "1", "1"]),
    ],
)  # fmt: skip
def test_a_profile_number_must_be_finite(client: httpx.Client, raw: bytes, loc: list) -> None:
    # an infinite delay would sleep forever, and the profile could no longer be read back
    r = client.put("/v1/emulators/search/profile", content=raw)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == loc and "finite" in r.json()["message"]
    assert client.get("/v1/emulators/search/profile").status_code == 200


@pytest.mark.parametrize(
    ("model", "loc"),
    [
        ({"kind": "constant", "value_s": True}, ["constant", "value_s"]),
        ({"kind": "lognormal", "median_s": 0.1, "sigma": True}, ["lognormal", "sigma"]),
        ({"kind": "empirical", "samples": [0.1, False]}, ["empirical", "samples", "1"]),
        (
            {"kind": "faulty", "model": FAST["model"], "faults": [{"type": "error", "rate": True}]},
            ["faulty", "faults", "0", "error", "rate"],
        ),
    ],
)
def test_a_profile_number_is_not_a_boolean(client: httpx.Client, model: dict, loc: list) -> None:
    # `value_s: true` was a 1-second delay, `rate: true` a fault on every call
    before = client.get("/v1/emulators/search/profile").json()
    r = client.put("/v1/emulators/search/profile", json={"model": model})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "model", *loc]
    assert "must be a number, not" in r.json()["message"]
    assert client.get("/v1/emulators/search/profile").json() == before  # nothing changed


def test_drifting_profile_follows_the_callers_step(client: httpx.Client) -> None:
    drift = {
        "model": {
            "kind": "drift",
            "by": "step",
            "schedule": [
                {"start": 0, "model": {"kind": "constant", "value_s": 0.01}},
                {"start": 3, "model": {"kind": "constant", "value_s": 0.03}},
            ],
        }
    }
    assert client.put("/v1/emulators/search/profile", json=drift).status_code == 200
    delays = [
        client.post("/v1/emulators/search/call", json={"query": "q", "step": s}).headers[INJECTED]
        for s in (0, 2, 3, 9)
    ]
    assert delays == ["10.000", "10.000", "30.000", "30.000"]
    by_header = client.post("/retrieve", json={"queries": ["q"]}, headers={"X-Step": "4"})
    assert by_header.headers[INJECTED] == "30.000"
    for bad in ("-1", "²"):  # "²" passes `str.isdigit` but not `int`: it was a 500
        step = bad.encode("latin-1")  # as sent on the wire (httpx sends str headers as ASCII)
        r = client.post("/retrieve", json={"queries": ["q"]}, headers={"X-Step": step})
        assert r.status_code == 400, r.text
        assert r.json()["detail"].startswith("X-Step must be a non-negative integer")
    r = client.post("/retrieve", json={"queries": ["q"]}, headers={"X-Step": "9" * 5000})
    assert r.status_code == 400, r.text  # past Python's 4300-digit int conversion: it was a 500
    assert r.json()["detail"].startswith("X-Step must be at most 9223372036854775807 ")


@pytest.mark.parametrize(
    ("option", "tool"), [("--profile", "search"), ("--reward-profile", "reward")]
)
def test_a_profile_option_wins_over_an_inline_profile_in_the_config(
    tmp_path: Path, option: str, tool: str
) -> None:
    # the command line is the highest precedence, but an inline `search_profile` in the config
    # file (or its env var) silently won over `--profile FILE`
    config = tmp_path / "toolenv.yaml"
    inline = {"tool": tool, "model": {"kind": "constant", "value_s": 0.5}}
    config.write_text(json.dumps({"emulators": {f"{tool}_profile": inline}}))
    given = tmp_path / "given.yaml"
    given.write_text(json.dumps({"tool": tool, **FAST, "source": "the command line"}))
    server = start_server("--config", str(config), option, str(given))
    try:
        active = httpx.get(f"{server.url}/v1/emulators/{tool}/profile").json()
    finally:
        server.stop()
    assert active["source"] == "the command line", active


def test_a_profile_the_emulator_refuses_names_its_file(tmp_path: Path) -> None:
    """With `--profile` and `--reward-profile` both given, a profile of the other tool (or a trace
    replay whose file is missing) said "field 'tool': this is the 'reward' emulator, the profile
    says 'search'" without naming the file, or the config setting, that was wrong."""
    search = shipped_profile_path("search_default")
    replay = tmp_path / "replay.yaml"
    replay.write_text("tool: search\nmodel: {kind: trace, paths: [nowhere.jsonl], tool: search}\n")
    config = tmp_path / "toolenv.yaml"
    config.write_text(
        "emulators:\n  search_profile: {tool: reward, model: {kind: constant, value_s: 1}}\n"
    )
    for args, said in [
        (["--profile", str(search), "--reward-profile", str(search)],
         f"error: {search}: field 'tool': this is the 'reward' emulator, the profile says 'search'"),
        (["--profile", str(replay)], f"error: {replay}: field 'model.paths.0': nowhere.jsonl: "),
        (["--config", str(config)],
         "error: emulators.search_profile: field 'tool': this is the 'search' emulator, "
         "the profile says 'reward'"),
    ]:  # fmt: skip
        out = subprocess.run(
            [sys.executable, "-m", "toolenv", "emulators", "serve", "--port", str(free_port()),
             *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 2, out.stderr
        assert out.stderr.startswith(said) and out.stderr.count("\n") == 1, out.stderr


def test_a_profile_that_names_no_tool_is_the_slot_it_is_given_for(tmp_path: Path) -> None:
    """As a PUT takes its path's tool: a reward profile without `tool:` (given to
    --reward-profile, or inline under `reward_profile:`) was refused at start with "the profile
    says 'search'", the field's default."""
    profile = tmp_path / "slow.yaml"
    profile.write_text("model: {kind: constant, value_s: 30}\n")
    config = tmp_path / "config.yaml"
    config.write_text("emulators:\n  reward_profile:\n    model: {kind: constant, value_s: 30}\n")
    for args in (["--reward-profile", str(profile)], ["--config", str(config)]):
        s = start_server(*args)
        try:
            got = httpx.get(s.url + "/v1/emulators/reward/profile").json()
            assert got["tool"] == "reward" and got["model"]["value_s"] == 30.0
        finally:
            s.stop()


def test_a_trace_replay_of_no_paths_names_the_field(client: httpx.Client) -> None:
    """`paths: []` read "no calls of tool 'search' in : no .jsonl or .log files there"."""
    before = client.get("/v1/emulators/search/profile").json()
    r = client.put("/v1/emulators/search/profile", json={"model": {"kind": "trace", "paths": []}})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "model", "trace", "paths"]
    assert "at least 1 item" in r.json()["message"] and " in : " not in r.text
    assert client.get("/v1/emulators/search/profile").json() == before
