"""The `cpu` profile: vLLM (vllm-cpu, the tiny test model) under compose, and a short
`toolenv rollout run --engine openai` through the published gateway port."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from compose_support import REPO, Stack
from testkit import free_port

sys.path.insert(0, str(REPO / "tests" / "rollout_client"))
from rollout_support import first_records, write_trace  # noqa: E402


@pytest.fixture(scope="module")
def vllm_url(stack: Stack, tiny_model_dir: Path) -> Iterator[str]:
    port = free_port()
    wheels = subprocess.run(
        ["bash", str(REPO / "scripts" / "build_wheelhouse.sh"), "--vllm"],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert wheels.returncode == 0, wheels.stdout + wheels.stderr
    stack.env.update(
        TOOLENV_VLLM_PORT=str(port),
        TOOLENV_MODEL_DIR=str(tiny_model_dir),
        TOOLENV_VLLM_CPU_IMAGE="toolenv/vllm-cpu:test",
    )
    try:
        up = stack.compose(
            "--profile", "cpu", "up", "-d", "--build", "--wait", "--wait-timeout", "300", "vllm-cpu"
        )
        assert up.returncode == 0, up.stderr[-4000:] + stack.logs()
        yield f"http://127.0.0.1:{port}"
    finally:
        stack.compose("--profile", "cpu", "rm", "-s", "-f", "vllm-cpu")


def test_rollout_through_the_compose_gateway_with_vllm_cpu(
    stack: Stack, vllm_url: str, tiny_model_dir: Path, polytrace_dir: Path, tmp_path: Path
) -> None:
    models = httpx.get(vllm_url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["toolenv-model"]
    before = _search_calls(stack)
    trace = write_trace(first_records(polytrace_dir, 3, min_turns=2), tmp_path / "three.jsonl")
    out = tmp_path / "out"
    argv = [
        sys.executable, "-m", "toolenv", "rollout", "run", "--engine", "openai",
        "--openai-url", vllm_url, "--model", str(tiny_model_dir), "--gateway", stack.url,
        "--trace", str(trace), "--batch", "3", "--policy", "sync", "--length-scale", "0.1",
        "--max-output", "16", "--max-append", "48", "--out", str(out), "--no-plots",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["steps"][0]["completed"] == 3
    assert _search_calls(stack) > before  # the tool calls went through the compose gateway


def _search_calls(stack: Stack) -> float:
    total = 0.0
    for line in stack.client.get("/metrics").text.splitlines():
        if line.startswith("toolenv_gateway_calls_total") and 'tool="search"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total
