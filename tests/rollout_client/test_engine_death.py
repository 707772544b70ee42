"""An engine that dies mid-run ends the run in one line (exit 3), the vLLM server's and the
in-process engine's alike: no traceback, no steps run against a dead engine."""

from __future__ import annotations

import asyncio
import json
import threading
import time
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


class _Stalls(_Models):
    """Streams one chunk of a completion, then falls silent with the connection open: what vLLM's
    streams do once it has taken SIGTERM (its listener closed, the process still up)."""

    release = threading.Event()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chunk = {"choices": [{"token_ids": [5], "finish_reason": None}]}
        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.flush()
        self.release.wait(30)


async def test_a_server_that_stops_taking_connections_mid_stream_ends_its_streams() -> None:
    """Before: vLLM given SIGTERM mid-run closed its listener and left its streams open and
    silent, and the rollout waited out the engine's 600 s read timeout. A server whose streams
    are silent is probed; once it refuses connections, its streams end in EngineUnreachable."""
    server = LoopbackHTTP(_Stalls).__enter__()
    try:
        engine = OpenAIEngine([server.url], stall_probe_s=0.5)
        await engine.start()
        try:
            got: list[list[int]] = []

            async def read() -> None:
                async for ids in engine.stream("r1", [1, 2], max_tokens=8):
                    got.append(ids)
                    if len(got) == 1:
                        server.stop()  # the listener closes; the stream stays open

            started = time.monotonic()
            with pytest.raises(EngineUnreachable) as caught:
                await asyncio.wait_for(read(), timeout=20)
            assert time.monotonic() - started < 5
        finally:
            await engine.close()
    finally:
        _Stalls.release.set()
        server.stop()
    assert got == [[5]]
    assert str(caught.value).startswith(
        f"OpenAI-compatible server {server.url} stopped answering mid-stream: "
    ), caught.value
    assert "silent for 0.5 s" in str(caught.value)


async def test_a_busy_server_that_still_answers_keeps_its_silent_streams() -> None:
    """The probe ends nothing while the server answers: a request queued on a saturated engine
    may be silent for long and still come."""
    _Stalls.release.clear()
    with LoopbackHTTP(_Stalls) as server:
        engine = OpenAIEngine([server.url], stall_probe_s=0.2)
        await engine.start()
        try:
            stream = engine.stream("r1", [1, 2], max_tokens=8)
            assert await anext(stream) == [5]
            with pytest.raises(TimeoutError):  # still open after several probes
                await asyncio.wait_for(anext(stream), timeout=1.5)
            assert not engine._gone
        finally:
            _Stalls.release.set()
            await engine.close()
