"""An engine that dies mid-run ends the run in one line (exit 3), the vLLM server's and the
in-process engine's alike: no traceback, no steps run against a dead engine."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from testkit import LoopbackHTTP, QuietHandler

from rollout_client.engines import EngineUnreachable, OpenAIEngine
from rollout_client.engines.vllm_engine import VllmEngine, VllmOptions


class _Models(QuietHandler):
    """An OpenAI-compatible server as far as `/v1/models` and `/metrics` go."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b'{"object": "list", "data": [{"id": "m"}]}' if self.path == "/v1/models" else b""
        self.reply(200, body)


async def test_an_openai_server_that_died_is_unreachable_not_a_traceback() -> None:
    """The vLLM server killed mid-run: the step's end read its /metrics and the run died in a
    120-line `httpx.ConnectError` traceback (exit 1), where an unreachable engine is one line
    and exit 3."""
    with LoopbackHTTP(_Models) as server:
        url = server.url
        engine = OpenAIEngine([url])
        await engine.start()
        try:
            assert await engine.prefix_cache_stats() is not None
            server.stop()
            with pytest.raises(EngineUnreachable) as caught:
                await engine.prefix_cache_stats()
        finally:
            await engine.close()
    assert str(caught.value) == (
        f"OpenAI-compatible server {url} stopped answering mid-run: All connection attempts failed"
    )


async def test_a_dead_vllm_engine_ends_the_run(tmp_path: Path) -> None:
    """vLLM's EngineCore killed in step 1 of 4: steps 2 and 3 still ran, each of their 64
    trajectories failing at once with EngineDeadError, and the table showed those steps with
    the engine 48% and 57% busy. The engine is checked at each step's end and start."""
    engine = VllmEngine(VllmOptions(model=tmp_path))
    engine._llm = SimpleNamespace(errored=True)  # what AsyncLLM says once its core is gone
    with pytest.raises(EngineUnreachable, match="vLLM's engine died mid-run"):
        await engine.prefix_cache_stats()
