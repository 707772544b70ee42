"""Pieces of the rollout client on their own: the simulator, the monitor, cost profiles,
calibration, the live parser, the OpenAI engine (workloads: test_rollout_workloads.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from testkit import LoopbackHTTP, QuietHandler

from rollout_client.calibrate import CalibrationPlan, calibrate_engine
from rollout_client.clock import VirtualEventLoop
from rollout_client.engines import (
    BUILTIN_PROFILES,
    CostModel,
    EngineMonitor,
    EventSimEngine,
    OpenAIEngine,
    load_cost_model,
)
from rollout_client.engines.openai_engine import EngineUnreachable
from rollout_client.workloads.live import LiveDriver, load_prompts
from rollout_client.workloads.plan import TrajectoryPlan, TurnPlan


async def test_sim_forces_lengths_counts_prefix_hits_in_blocks_and_aborts() -> None:
    cost = CostModel(
        prefill_per_token_s=0, decode_base_s=0.001, decode_per_seq_s=0, max_batch=4, block_size=16
    )
    engine = EventSimEngine(cost)
    await engine.start()
    try:
        g1 = await engine.generate(
            "a", list(range(40)), max_tokens=7, min_tokens=7, ignore_eos=True, route_key="t"
        )
        assert len(g1.token_ids) == 7 and all(0 <= t < 100 for t in g1.token_ids)
        assert g1.cached_tokens == 0
        # The next turn of the same trajectory reuses its 47-token context: 2 whole blocks.
        g2 = await engine.generate(
            "b", list(range(60)), max_tokens=3, min_tokens=3, ignore_eos=True, route_key="t"
        )
        assert g2.cached_tokens == 32
        stats = await engine.prefix_cache_stats()
        assert (stats.queries, stats.hits) == (100, 32)
        task = asyncio.create_task(
            engine.generate("c", [1] * 10, max_tokens=10_000, min_tokens=10_000)
        )
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.01)
        assert engine.monitor.in_flight == 0 and not engine._running
    finally:
        await engine.close()


async def test_sim_batch_limit_queues_requests() -> None:
    cost = CostModel(
        prefill_per_token_s=0, decode_base_s=0.01, decode_per_seq_s=0, max_batch=2, block_size=16
    )
    engine = EventSimEngine(cost)
    await engine.start()
    try:
        gens = await asyncio.gather(
            *(engine.generate(f"r{i}", [1, 2], max_tokens=5) for i in range(4))
        )
        # Two waves of 5 iterations: the second pair queued for the whole first wave.
        assert min(g.queue_s for g in gens[2:]) >= 0.04
        assert max(g.queue_s for g in gens[:2]) < min(g.queue_s for g in gens[2:])
    finally:
        await engine.close()


def test_monitor_busy_fraction_and_occupancy() -> None:
    m = EngineMonitor(capacity=4)
    m.change(+1, at=1.0)
    m.change(+1, at=2.0)
    m.change(-2, at=3.0)
    busy, occupancy = m.window(0.0, 4.0)
    assert busy == pytest.approx(0.5)
    assert occupancy == pytest.approx((1 * 1 + 2 * 1) / 4 / 4)
    assert m.timeline(0.0, 4.0)[0] == (0.0, 0)


def test_cost_profiles(tmp_path: Path) -> None:
    assert load_cost_model("searchr1-qwen7b") is BUILTIN_PROFILES["searchr1-qwen7b"]
    path = tmp_path / "p.json"
    BUILTIN_PROFILES["vllm-cpu-tiny"].save(path)
    assert load_cost_model(str(path)) == BUILTIN_PROFILES["vllm-cpu-tiny"]
    with pytest.raises(ValueError, match="neither a built-in"):
        load_cost_model("nope")


def test_a_cost_profile_that_does_not_validate_is_one_line_naming_the_field(tmp_path: Path) -> None:
    # it was pydantic's text, over several lines and ending in a URL
    path = tmp_path / "p.json"
    data = BUILTIN_PROFILES["vllm-cpu-tiny"].model_dump(mode="json")
    path.write_text(json.dumps({**data, "max_batch": True}))
    with pytest.raises(ValueError) as caught:
        load_cost_model(str(path))
    assert str(caught.value) == (
        f"cost profile {path}: field 'max_batch': must be a number, not true "
        "(a JSON boolean is not read as 0 or 1)"
    )
    path.write_text("{")
    with pytest.raises(ValueError, match=r"does not parse: Expecting property name"):
        load_cost_model(str(path))
    for text, held in (("[1]", "an array"), ("null", "null"), ("3", "a value")):
        path.write_text(text)  # was "field '': Input should be a valid dictionary or instance..."
        with pytest.raises(ValueError) as caught:
            load_cost_model(str(path))
        assert str(caught.value) == (
            f"cost profile {path}: holds {held}, not a JSON object of costs (as `toolenv "
            "rollout calibrate --out` writes)"
        )


def test_a_cost_profile_with_a_misspelt_field_is_refused(tmp_path: Path) -> None:
    """`kv_capacity` for `kv_capacity_tokens` was dropped without a word: the run went on with
    no KV-cache limit, the one thing the profile meant to set."""
    path = tmp_path / "p.json"
    data = BUILTIN_PROFILES["vllm-cpu-tiny"].model_dump(mode="json")
    path.write_text(json.dumps({**data, "kv_capacity": 4096}))
    with pytest.raises(ValueError) as caught:
        load_cost_model(str(path))
    assert str(caught.value) == (
        f"cost profile {path}: unknown field 'kv_capacity' (did you mean kv_capacity_tokens?)"
    )


async def test_calibrate_recovers_a_known_cost_model() -> None:
    truth = CostModel(
        prefill_per_token_s=40e-6,
        decode_base_s=0.004,
        decode_per_seq_s=0.001,
        max_batch=64,
        block_size=16,
    )
    plan = CalibrationPlan(batches=[1, 8, 24], prompt_lens=[64, 1024], decode_tokens=12)
    fitted = await calibrate_engine(EventSimEngine(truth), plan, name="t", vocab_size=1024)
    assert fitted.decode_per_seq_s == pytest.approx(truth.decode_per_seq_s, rel=0.35)
    assert fitted.decode_base_s == pytest.approx(truth.decode_base_s, abs=0.003)
    assert fitted.prefill_per_token_s == pytest.approx(truth.prefill_per_token_s, rel=0.5)


def test_live_parser_reads_tagged_calls_and_fenced_code() -> None:
    from rollout_client.workloads.live import parse_tool_call, render_observation

    call = parse_tool_call(
        'think... <tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call> more'
    )
    assert (call.tool, call.arguments, call.error) == ("search", {"query": "x"}, None)
    stringly = parse_tool_call(
        '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"y\\"}"}</tool_call>'
    )
    assert stringly.arguments == {"query": "y"}
    code = parse_tool_call("Let me check:\n```python\nprint(1 + 1)\n```\n")
    assert (code.tool, code.arguments) == (
        "sandbox",
        {"code": "print(1 + 1)\n", "language": "python"},
    )
    first = parse_tool_call(
        '```sh\nls\n```\n<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    )
    assert first.tool == "sandbox" and first.arguments["language"] == "bash"
    broken = parse_tool_call("<tool_call>{name: search}</tool_call>")
    assert broken.error and "not valid JSON" in broken.error
    assert parse_tool_call("The answer is 42.") is None
    assert render_observation("timeout", error="deadline") == (
        '<tool_response>{"status": "timeout", "error": "deadline"}</tool_response>'
    )


@pytest.mark.parametrize(
    ("text", "engine_reason", "recorded"),
    [
        ("The answer is", "length", "length"),  # cut at max_tokens: it was recorded "stop"
        ("The answer is 42.", "stop", "stop"),
        ("The answer is 42.", None, "stop"),  # an engine that gives no reason
        ('<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>', "length",
         "tool_calls"),
    ],
)  # fmt: skip
def test_a_live_turn_ends_as_the_engine_and_its_text_say(
    text: str, engine_reason: str | None, recorded: str
) -> None:
    driver = LiveDriver(encode=lambda s: list(s.encode()), decode=lambda ids: bytes(ids).decode())
    plan = TrajectoryPlan("t", 4, [TurnPlan(12, forced=False)])
    driver.after_turn(plan, 0, list(text.encode()), engine_reason)
    assert plan.turns[0].finish_reason == recorded


def test_live_prompts_that_cannot_be_read_name_the_file_and_line(tmp_path: Path) -> None:
    """`--live` with a missing file or a directory was a traceback (FileNotFoundError, exit 1),
    and a non-UTF-8 byte a bare "'utf-8' codec can't decode" naming neither file nor line."""
    missing, folder, binary = tmp_path / "none.jsonl", tmp_path / "dir", tmp_path / "bin.jsonl"
    folder.mkdir()
    binary.write_bytes(b'{"prompt": "fine"}\n\xff\xfe\n')
    cases = [
        (missing, f"{missing}: cannot read the --live prompts: No such file or directory"),
        (folder, f"{folder}: cannot read the --live prompts: Is a directory"),
        (binary, f"{binary}:2: not UTF-8 text (invalid start byte)"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError) as caught:
            list(load_prompts(path))
        assert str(caught.value) == message


def test_openai_engine_pins_each_trajectory_to_one_server() -> None:
    from rollout_client.engines import OpenAIEngine

    engine = OpenAIEngine(["http://a", "http://b"], capacity=4)
    assert engine.monitor.capacity == 8
    first = engine.server_for("t1")
    engine._load[first] += 1  # t1 is running there: the next new trajectory goes to the other one
    second = engine.server_for("t2")
    assert second != first
    engine._load[first] -= 1
    assert [engine.server_for("t1") for _ in range(3)] == [first] * 3
    assert engine.server_for("t2") == second
    with pytest.raises(ValueError, match="--openai-url"):
        OpenAIEngine([])


class _NotOpenAI(QuietHandler):
    """Another web server on the port: `/v1/models` answers 404, or 200 with other content."""

    answers = {"/404/v1/models": (404, b"no"), "/text/v1/models": (200, b"hello")}
    answers["/json/v1/models"] = (200, b'{"object": "list"}')

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        status, body = self.answers.get(self.path, (404, b""))
        self.reply(status, body)


@pytest.mark.parametrize(
    ("prefix", "said"), [("404", "HTTP 404"), ("text", "no model"), ("json", "no model")]
)
async def test_a_server_that_is_not_openai_compatible_is_one_line(prefix: str, said: str) -> None:
    """A 404 from /v1/models came out as two lines (httpx's "For more information check: ..."),
    saying the server "does not answer"; a 200 that listed no model was a KeyError traceback (or
    a bare "Expecting value" naming no server). Each is one line naming the URL."""
    with LoopbackHTTP(_NotOpenAI) as server:
        url = f"{server.url}/{prefix}"
        with pytest.raises(EngineUnreachable) as info:
            await OpenAIEngine([url]).start()
    assert str(info.value) == (
        f"{url} answered GET /v1/models with {said}"
        + (" (data[0].id)" if said == "no model" else "")
        + ": not an OpenAI-compatible server (--openai-url)"
    )


class _OneModel(QuietHandler):
    """`/v1/models` at the server's root lists one model; every other path is a 404."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b'{"object": "list", "data": [{"id": "m"}]}' if self.path == "/v1/models" else b""
        self.reply(200 if body else 404, body)


@pytest.mark.parametrize("given", ["", "/", "/v1", "/v1/"])
async def test_an_openai_client_base_url_ending_in_v1_is_the_servers_root(given: str) -> None:
    """`--openai-url http://host:8000/v1`, the base URL an OpenAI client takes, asked for
    /v1/v1/models and was refused as "not an OpenAI-compatible server"."""
    with LoopbackHTTP(_OneModel) as server:
        root = server.url
        engine = OpenAIEngine([root + given])
        try:
            await engine.start()
        finally:
            await engine.close()
    assert engine.base_urls == [root] and engine.model == "m"


class _LateLoop(VirtualEventLoop):
    """A virtual clock whose timers all fire 2 ms late: a host a little behind, every time."""

    def call_at(self, when, callback, *args, context=None):  # type: ignore[no-untyped-def]
        return super().call_at(when + 0.002, callback, *args, context=context)


def test_the_sim_counts_every_late_wake_up_as_lag() -> None:
    """Only wake-ups over 5 ms late counted: at --time-scale 20 the sim's 1-4 ms late timers made
    a 64-trajectory step 12% longer (modelled) and the note on a simulator behind its cost model
    stayed silent. Each late wake-up adds to the modelled times, so each counts."""
    cost = CostModel(
        prefill_per_token_s=0, decode_base_s=0.01, decode_per_seq_s=0, max_batch=4, block_size=16
    )
    engine = EventSimEngine(cost)

    async def main() -> float:
        await engine.start()
        started = asyncio.get_running_loop().time()
        await engine.generate("a", [1] * 8, max_tokens=5, min_tokens=5, ignore_eos=True)
        await engine.generate("b", [2] * 8, max_tokens=5, min_tokens=5, ignore_eos=True)
        return asyncio.get_running_loop().time() - started

    with asyncio.Runner(loop_factory=_LateLoop) as runner:
        took = runner.run(main())
    assert engine.lag_s >= 0.002 * 2  # at least one late wake-up per request
    # each request: its prefill (free here) makes the first token, 4 decode iterations the rest
    assert took == pytest.approx(2 * 4 * 0.01 + engine.lag_s)  # the lateness added up
