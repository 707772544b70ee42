"""The search emulator's state: active profile, seeded rng, document cache, optional BM25 corpus."""

from __future__ import annotations

import json
from typing import NamedTuple

import anyio
import numpy as np

from toolenv_core.latency.profile import Profile
from toolenv_core.latency.samplers import Sampler
from toolenv_core.polytrace.errors import TraceFormatError

from ..base import ToolEmulator
from ..settings import EmulatorSettings
from .corpus import Bm25Corpus, read_corpus
from .documents import TOKENS_PER_DOC_FALLBACK, DocumentCache, query_rng


class _Sizing(NamedTuple):
    """A profile and the response sizes drawn under it, swapped together (`activate`)."""

    profile: Profile
    drawn: dict[tuple[str, int], int]  # tokens per (query, topk)


class SearchEmulator(ToolEmulator):
    name = "search"

    def __init__(self, settings: EmulatorSettings, profile: Profile) -> None:
        super().__init__(settings, profile, seed_index=1)
        self.documents = DocumentCache(
            settings.seed, settings.document_cache_size, int(settings.document_cache_mb * 2**20)
        )
        self.corpus: Bm25Corpus | None = None
        self.corpus_docs: list[dict[str, str]] | None = None
        if settings.corpus is not None:
            try:
                self.corpus_docs = read_corpus(settings.corpus)
            except (TraceFormatError, OSError, UnicodeDecodeError) as exc:
                where = "" if isinstance(exc, TraceFormatError) else f"{settings.corpus}: "
                raise ValueError(f"invalid emulators settings: corpus: {where}{exc}") from exc
        self._sizing = _Sizing(profile, {})

    async def start(self) -> None:
        if self.corpus_docs is not None:
            self.corpus = await anyio.to_thread.run_sync(Bm25Corpus, self.corpus_docs)

    async def close(self) -> None:
        self.corpus = None

    def activate(self, profile: Profile, sampler: Sampler) -> None:
        super().activate(profile, sampler)
        self._sizing = _Sizing(profile, {})

    def tokens_for(self, query: str, topk: int, sizing: _Sizing | None = None) -> int:
        """Response tokens of one query's top-k list: drawn per (seed, query) from the profile,
        at most `max_response_tokens` (a profile's draw is bounded like a caller's request: a
        huge one was a 500 or a response of gigabytes)."""
        profile, drawn = sizing or self._sizing
        key = (query, topk)
        cached = drawn.get(key)
        if cached is not None:
            return cached
        model = profile.response_tokens
        ref_topk = profile.reference.get("topk", 3.0)
        if model is None:
            n = TOKENS_PER_DOC_FALLBACK * topk
        else:
            per_ref = model.build().sample(query_rng(self.settings.seed, query, "tokens"))
            scaled = min(per_ref * topk / ref_topk, self.settings.max_response_tokens)
            n = max(2 * topk, round(scaled))
        if len(drawn) >= max(1, self.settings.document_cache_size):
            drawn.clear()
        drawn[key] = n
        return n

    def split_budget(self, queries: list[str], topk: int, response_tokens: int | None) -> list[int]:
        """Each query's response tokens. A heavy reply's are drawn on the worker thread that
        renders it (256 new queries took 15-35 ms on the event loop), under the profile active
        when they are drawn: read once, so a swap meanwhile cannot mix two profiles' sizes."""
        if response_tokens is None:
            sizing = self._sizing
            return [self.tokens_for(q, topk, sizing) for q in queries]
        base, extra = divmod(response_tokens, len(queries))
        return [max(2 * topk, base + (1 if i < extra else 0)) for i in range(len(queries))]

    def synthetic(self, queries: list[str], topk: int, budgets: list[int], scores: bool) -> bytes:
        parts = [
            self.documents.get(q, topk, n, scores) for q, n in zip(queries, budgets, strict=True)
        ]
        return b"[" + b",".join(parts) + b"]"

    async def retrieve_real(self, queries: list[str], topk: int, scores: bool) -> bytes:
        assert self.corpus is not None
        found = await anyio.to_thread.run_sync(self.corpus.search, queries, topk)
        if not scores:
            found = [[item["document"] for item in row] for row in found]
        return json.dumps(found, separators=(",", ":")).encode()

    def profile_summary(self) -> dict:
        samples = self.profile.model.build().sample_many(np.random.default_rng(0), 2000)
        return {"p50_s": float(np.median(samples)), "mean_s": float(samples.mean())}
