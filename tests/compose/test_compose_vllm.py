"""The `cpu` profile end to end: `docker compose --profile cpu up` adds vllm-cpu serving the tiny
test model, and a short `toolenv rollout run --engine openai` drives it and the tools through the
two published ports (vLLM's and the gateway's), from the host.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from compose_support import REPO, Stack
from testkit import free_port

pytestmark = [pytest.mark.compose, pytest.mark.vllm, pytest.mark.timeout(900)]
VLLM_IMAGE = "toolenv/vllm-cpu:test"
TRAJECTORIES = 3


@pytest.fixture(scope="module")
def vllm_url(stack: Stack, tiny_model_dir: Path) -> Iterator[str]:
    """The whole project up with `--profile cpu`; vllm-cpu is removed again after the module."""
    wheels = subprocess.run(
        ["bash", str(REPO / "scripts" / "build_wheelhouse.sh"), "--vllm"],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert wheels.returncode == 0, wheels.stdout[-2000:] + wheels.stderr[-4000:]
    port = free_port()
    stack.env.update(
        TOOLENV_VLLM_PORT=str(port),
        TOOLENV_MODEL_DIR=str(tiny_model_dir),
        TOOLENV_VLLM_CPU_IMAGE=VLLM_IMAGE,
    )
    try:
        up = stack.compose(
            "--profile", "cpu", "up", "-d", "--build", "--wait", "--wait-timeout", "300"
        )  # fmt: skip
        assert up.returncode == 0, up.stderr[-4000:] + stack.logs()
        yield f"http://127.0.0.1:{port}"
    finally:
        stack.compose("--profile", "cpu", "rm", "--stop", "--force", "-v", "vllm-cpu")


def test_rollout_through_the_published_ports_of_the_cpu_profile(
    stack: Stack, vllm_url: str, tiny_model_dir: Path, polytrace_dir: Path, tmp_path: Path
) -> None:
    models = httpx.get(vllm_url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["toolenv-model"]
    assert stack.client.get("/readyz").status_code == 200
    calls_before, generated_before = _search_calls(stack), _generated_tokens(vllm_url)
    out = tmp_path / "out"
    argv = [
        sys.executable, "-m", "toolenv", "rollout", "run", "--engine", "openai",
        "--openai-url", vllm_url, "--model", str(tiny_model_dir), "--gateway", stack.url,
        "--trace", str(polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"),
        "--limit", str(TRAJECTORIES), "--batch", str(TRAJECTORIES), "--policy", "sync",
        "--length-scale", "0.1", "--max-output", "16", "--max-append", "48",
        "--out", str(out), "--no-plots",
    ]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert time.monotonic() - started < 120

    step = json.loads((out / "report.json").read_text())["steps"][0]
    assert (step["completed"], step["failed"]) == (TRAJECTORIES, 0), step["failures"]
    # The first three search_r1 trajectories make 1 + 4 + 3 search calls.
    assert step["tool_calls"] == 8 and step["tool_errors"] == step["tool_timeouts"] == 0
    records = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    calls = [c for r in records for c in r["tool_calls"]]
    assert len(calls) == 8 and {(c["tool_name"], c["status"]) for c in calls} == {
        ("search", "success")
    }
    assert all(c["append_len"] > 0 for c in calls)  # each answer went back into the context
    # Every call went through the compose gateway, and succeeded there.
    assert _search_calls(stack) - calls_before == 8
    # Generation happened in the compose vLLM: its own counter moved by what the report says.
    generated = sum(t["completion_tokens"] for r in records for t in r["turns"])
    assert generated == step["generated_tokens"] > 0
    assert _generated_tokens(vllm_url) - generated_before == generated


def _search_calls(stack: Stack) -> float:
    """Successful search calls the gateway has counted (its Prometheus /metrics)."""
    wanted = 'toolenv_gateway_calls_total{outcome="ok",tool="search"}'
    return _metric(stack.client.get("/metrics").text, wanted)


def _generated_tokens(vllm_url: str) -> float:
    text = httpx.get(vllm_url + "/metrics", timeout=10).text
    return _metric(text, "vllm:generation_tokens_total{")


def _metric(text: str, prefix: str) -> float:
    values = [
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    ]
    assert values, f"no {prefix} in /metrics"
    return sum(values)
