"""The `openai` engine against a real OpenAI-compatible vLLM server of the tiny model
(`python -m vllm.entrypoints.openai.api_server`), one server for the module (ready in ~30 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from rollout_support import first_records, start_gateway, write_trace
from testkit import ServerProcess, free_port

from rollout_client.engines import OpenAIEngine
from rollout_client.workloads.plan import TokenSynth
from toolenv_core.polytrace import read_multiturn

pytestmark = pytest.mark.vllm
in_module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest.fixture(scope="module")
def vllm_server(vllm_module, tiny_model_dir: Path) -> Iterator[ServerProcess]:
    port = free_port()
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "4096",
        "--enforce-eager", "--block-size", "32", "--max-num-seqs", "16", "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        # vLLM reserves this share of the NUMA node's memory and refuses to start when less is free
        # (default 0.92); the tiny model needs a fraction of it.
        "--gpu-memory-utilization", "0.5",
    ]  # fmt: skip
    server = ServerProcess(argv, f"http://127.0.0.1:{port}").start("/health", timeout=300)
    yield server
    server.stop(timeout=30)


@pytest.fixture(scope="module")
def gateway() -> Iterator[ServerProcess]:
    server = start_gateway()
    yield server
    server.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(vllm_server) -> AsyncIterator[OpenAIEngine]:
    eng = OpenAIEngine([vllm_server.url], capacity=16)
    await eng.start()
    yield eng
    await eng.close()


@in_module_loop
async def test_token_ids_in_and_out_and_the_server_prefix_cache_hits(
    engine, tiny_model_dir
) -> None:
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    prompt = TokenSynth(vocab_size=vocab).ids("openai-test", 100)
    before = await engine.prefix_cache_stats()
    first = await engine.generate(
        "o1", prompt, max_tokens=20, min_tokens=20, ignore_eos=True, route_key="t"
    )
    assert len(first.token_ids) == 20 and all(0 <= t < vocab for t in first.token_ids)
    assert first.cached_tokens == 0
    second_prompt = prompt + first.token_ids + TokenSynth(vocab_size=vocab).ids("tool", 40)
    second = await engine.generate(
        "o2", second_prompt, max_tokens=7, min_tokens=7, ignore_eos=True, route_key="t"
    )
    assert len(second.token_ids) == 7
    assert second.cached_tokens == 96  # 120 tokens of shared context: 3 whole 32-token blocks
    after = await engine.prefix_cache_stats()
    assert after.queries - before.queries == len(prompt) + len(second_prompt)
    assert after.hits - before.hits == 96


@in_module_loop
async def test_cli_replay_through_the_gateway_matches_the_trace(
    vllm_server, gateway, tiny_model_dir, polytrace_dir, tmp_path
) -> None:
    records = first_records(polytrace_dir, 3, min_turns=2)
    trace = write_trace(records, tmp_path / "three.jsonl")
    out = tmp_path / "out"
    argv = [
        sys.executable, "-m", "toolenv", "rollout", "run", "--engine", "openai", "--openai-url", vllm_server.url,
        "--model", str(tiny_model_dir), "--gateway", gateway.url, "--trace", str(trace), "--batch", "3",
        "--policy", "sync", "--length-scale", "0.1", "--max-output", "16", "--max-append", "48", "--exact",
        "--out", str(out), "--no-plots",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["steps"][0]["completed"] == 3
    assert report["steps"][0]["prefix_cache"]["hits"] > 0  # from the server's /metrics
    for record, raw in zip(
        sorted(read_multiturn(out / "trajectories.jsonl"), key=lambda r: r.sample_id),
        sorted(records, key=lambda r: r["sample_id"]),
        strict=True,
    ):
        want = [min(16, -(-t["completion_tokens"] // 10)) for t in raw["turns"]]
        assert [t.completion_tokens for t in record.turns] == want
        assert all(t.cached_tokens >= 32 for t in record.turns[1:])


def test_calibrate_fits_a_cost_model_from_the_server(vllm_server, tiny_model_dir, tmp_path) -> None:
    out = tmp_path / "profile.json"
    argv = [
        sys.executable, "-m", "toolenv", "rollout", "calibrate", "--engine", "openai", "--openai-url", vllm_server.url,
        "--model", str(tiny_model_dir), "--batches", "1,4", "--prompt-lens", "32,256", "--decode-tokens", "8",
        "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    profile = json.loads(out.read_text())
    assert profile["decode_base_s"] > 0 and profile["max_batch"] == 64
    assert "calibrate --engine openai" in profile["source"]
    dead = subprocess.run(
        [*argv[:8], f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path / "x.json")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (
        dead.returncode == 3 and "does not answer" in dead.stderr and "Traceback" not in dead.stderr
    )
    assert httpx.get(vllm_server.url + "/health").status_code == 200
