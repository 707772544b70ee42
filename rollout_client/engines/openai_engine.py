"""Any OpenAI-compatible completion server (`vllm serve`, SGLang, ...), token ids in and out.

Each request posts a token-id prompt to `/v1/completions` with `return_token_ids: true`,
`min_tokens` and `ignore_eos`, streaming, and reads the new ids from every chunk. With several
servers, each trajectory (`route_key`) is pinned to one of them on its first turn (the least
loaded one) and stays there, so its later turns hit that server's prefix cache. Aborting a
request closes its stream; vLLM aborts a request whose client went away. A server whose
streams fall silent is probed (`_watch`): one that no longer takes connections ends them.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator

import httpx
from httpx_sse import EventSource

from .base import Chunk, Engine, EngineUnreachable, PrefixCacheStats


def _served_model(response: httpx.Response) -> str | None:
    """The first model id a `/v1/models` answer lists; None when it lists none (or is not JSON):
    such an answer (another web server on the port) had raised a KeyError, a traceback."""
    try:
        data = response.json().get("data")
        model = data[0]["id"]
    except (ValueError, AttributeError, LookupError, TypeError):
        return None
    return model if isinstance(model, str) else None


class OpenAIEngine(Engine):
    name = "openai"

    def __init__(
        self,
        base_urls: list[str],
        model: str | None = None,
        capacity: int = 64,
        timeout_s: float = 600.0,
        stall_probe_s: float = 15.0,
    ) -> None:
        if not base_urls:
            raise ValueError("the openai engine needs at least one --openai-url")
        super().__init__(capacity=capacity * len(base_urls))
        # The server's root: an OpenAI client's base URL (`http://host:8000/v1`) works too; it
        # asked for /v1/v1/models and said "not an OpenAI-compatible server" of a vLLM server.
        self.base_urls = [u.rstrip("/").removesuffix("/v1") for u in base_urls]
        self.model = model
        self._timeout = timeout_s
        self.stall_probe_s = stall_probe_s
        self._client: httpx.AsyncClient | None = None
        self._pins: dict[str, int] = {}
        self._load = [0] * len(self.base_urls)
        self._heard = [0.0] * len(self.base_urls)  # monotonic time of each server's last sign
        self._gone: dict[int, str] = {}  # servers found gone mid-run, and why
        self._open: dict[str, tuple[int, httpx.Response]] = {}
        self._watchdog: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(self._timeout, connect=10.0))
        for url in self.base_urls:
            try:
                r = await self._client.get(url + "/v1/models")
            except httpx.HTTPError as exc:
                await self.close()
                why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise EngineUnreachable(
                    f"OpenAI-compatible server {url} does not answer: {why}"
                ) from exc
            served = _served_model(r)
            if r.status_code != 200 or (self.model is None and served is None):
                await self.close()
                said = f"HTTP {r.status_code}" if r.status_code != 200 else "no model (data[0].id)"
                raise EngineUnreachable(
                    f"{url} answered GET /v1/models with {said}: not an OpenAI-compatible server "
                    "(--openai-url)"
                )
            if self.model is None:
                self.model = served
        self._watchdog = asyncio.create_task(self._watch())

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def server_for(self, route_key: str | None) -> int:
        """The server a trajectory is pinned to (assigned on first use, least loaded)."""
        if route_key is None:
            return min(range(len(self._load)), key=self._load.__getitem__)
        if route_key not in self._pins:
            self._pins[route_key] = min(range(len(self._load)), key=self._load.__getitem__)
        return self._pins[route_key]

    def unpin(self, route_key: str) -> None:
        self._pins.pop(route_key, None)

    async def _raw_stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        min_tokens: int,
        ignore_eos: bool,
        route_key: str | None,
    ) -> AsyncIterator[Chunk]:
        if self._client is None:
            raise RuntimeError("OpenAIEngine.start() was not called")
        index = self.server_for(route_key)
        body = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "min_tokens": min_tokens,
            "ignore_eos": ignore_eos,
            "return_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 1.0,
        }
        self._load[index] += 1
        try:
            async with self._client.stream(
                "POST",
                self.base_urls[index] + "/v1/completions",
                json=body,
                headers={"X-Request-Id": request_id},
            ) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:300]
                    raise RuntimeError(
                        f"{self.base_urls[index]} answered {response.status_code}: {detail}"
                    )
                self._open[request_id] = (index, response)
                self._heard[index] = time.monotonic()
                finished = False
                try:
                    async for chunk in self._chunks(index, response):
                        finished = finished or chunk.finish_reason is not None
                        yield chunk
                except (httpx.HTTPError, httpx.StreamError) as exc:
                    if index in self._gone:
                        raise EngineUnreachable(self._gone[index]) from exc
                    raise
                if index in self._gone:  # a stream closed by `_watch` may just end
                    raise EngineUnreachable(self._gone[index])
                if not finished:  # was taken for a short turn that had finished
                    raise RuntimeError(
                        f"{self.base_urls[index]} ended the stream before the answer finished "
                        "(no finish_reason)"
                    )
        finally:
            self._load[index] -= 1
            self._open.pop(request_id, None)

    async def _chunks(self, index: int, response: httpx.Response) -> AsyncIterator[Chunk]:
        """The chunks of one streamed answer; each event is a sign the server lives."""
        # SSE lines end at CR or LF alone; httpx's aiter_lines also broke a chunk at a
        # U+2028 or U+0085 in its text (JSON leaves them unescaped): a JSONDecodeError
        async for event in EventSource(response).aiter_sse():
            self._heard[index] = time.monotonic()
            if event.data == "[DONE]":
                continue
            data = json.loads(event.data)
            if isinstance(data.get("error"), dict):  # vLLM's failure after the stream began
                why = data["error"].get("message") or "an error event"
                raise RuntimeError(f"{self.base_urls[index]} failed the request mid-stream: {why}")
            usage = data.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            for choice in data.get("choices") or []:
                yield Chunk(
                    token_ids=list(choice.get("token_ids") or []),
                    finish_reason=choice.get("finish_reason"),
                    cached_tokens=cached,
                )
            if not data.get("choices") and cached is not None:
                yield Chunk(token_ids=[], cached_tokens=cached)

    async def abort(self, request_id: str) -> None:
        opened = self._open.pop(request_id, None)
        if opened is not None:
            await opened[1].aclose()

    async def _watch(self) -> None:
        """vLLM on SIGTERM closes its listener and leaves its streams open and silent: the run
        waited out the read timeout (10 minutes) before it failed. A server whose streams have
        all been silent for `stall_probe_s` is asked for `/v1/models`; one that refuses the
        connection has its streams closed, which end in `EngineUnreachable` (as the step's end
        then does). A saturated server still answers, and its queued requests wait on."""
        while True:
            await asyncio.sleep(self.stall_probe_s / 2)
            for index, url in enumerate(self.base_urls):
                silent = time.monotonic() - self._heard[index] >= self.stall_probe_s
                if index in self._gone or not self._load[index] or not silent:
                    continue
                why = await self._unreachable(url)
                if why is None:
                    self._heard[index] = time.monotonic()
                    continue
                self._gone[index] = (
                    f"OpenAI-compatible server {url} stopped answering mid-stream: {why} (its "
                    f"streams silent for {self.stall_probe_s:g} s)"
                )
                for opened_index, response in list(self._open.values()):
                    if opened_index == index:
                        await response.aclose()

    async def _unreachable(self, url: str) -> str | None:
        """Why the server cannot be reached, or None while it answers (a slow answer, even an
        error status, is a server that lives: only a refused or broken connection is not)."""
        assert self._client is not None
        try:
            await self._client.get(url + "/v1/models", timeout=self.stall_probe_s)
        except httpx.TimeoutException:
            return None
        except httpx.HTTPError as exc:
            return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None

    async def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Sum of `vllm:prefix_cache_queries_total` / `hits_total` over every server's /metrics."""
        if self._client is None:
            return None
        total = PrefixCacheStats(0.0, 0.0)
        for url in self.base_urls:
            try:
                text = (await self._client.get(url + "/metrics")).text
            except httpx.HTTPError as exc:  # the server died mid-run: was a 120-line traceback
                why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise EngineUnreachable(
                    f"OpenAI-compatible server {url} stopped answering mid-run: {why}"
                ) from exc
            total.queries += _sum_metric(text, "vllm:prefix_cache_queries_total")
            total.hits += _sum_metric(text, "vllm:prefix_cache_hits_total")
        return total


def _sum_metric(text: str, name: str) -> float:
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)$", re.M)
    return sum(float(m.group(1)) for m in pattern.finditer(text))
