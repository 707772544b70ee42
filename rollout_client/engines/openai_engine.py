"""Any OpenAI-compatible completion server (`vllm serve`, SGLang, ...), token ids in and out.

Each request posts a token-id prompt to `/v1/completions` with `return_token_ids: true`,
`min_tokens` and `ignore_eos`, streaming, and reads the new ids from every chunk. With several
servers, each trajectory (`route_key`) is pinned to one of them on its first turn (the least
loaded one) and stays there, so its later turns hit that server's prefix cache. Aborting a
request closes its stream; vLLM aborts a request whose client went away.
"""

from __future__ import annotations

import json
import re
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
    ) -> None:
        if not base_urls:
            raise ValueError("the openai engine needs at least one --openai-url")
        super().__init__(capacity=capacity * len(base_urls))
        # The server's root: an OpenAI client's base URL (`http://host:8000/v1`) works too; it
        # asked for /v1/v1/models and said "not an OpenAI-compatible server" of a vLLM server.
        self.base_urls = [u.rstrip("/").removesuffix("/v1") for u in base_urls]
        self.model = model
        self._timeout = timeout_s
        self._client: httpx.AsyncClient | None = None
        self._pins: dict[str, int] = {}
        self._load = [0] * len(self.base_urls)
        self._open: dict[str, httpx.Response] = {}

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

    async def close(self) -> None:
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
                self._open[request_id] = response
                # SSE lines end at CR or LF alone; httpx's aiter_lines also broke a chunk at a
                # U+2028 or U+0085 in its text (JSON leaves them unescaped): a JSONDecodeError
                async for event in EventSource(response).aiter_sse():
                    if event.data == "[DONE]":
                        continue
                    data = json.loads(event.data)
                    if isinstance(data.get("error"), dict):  # vLLM's failure after the stream began
                        why = data["error"].get("message") or "an error event"
                        raise RuntimeError(
                            f"{self.base_urls[index]} failed the request mid-stream: {why}"
                        )
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
        finally:
            self._load[index] -= 1
            self._open.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        response = self._open.pop(request_id, None)
        if response is not None:
            await response.aclose()

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
