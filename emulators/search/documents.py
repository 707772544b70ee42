"""Deterministic synthetic documents sized in tokens.

Token counting rule: one token per whitespace-separated word of a document's `contents` (title
words included). The words come from a fixed vocabulary of short pseudo-words (2-3 syllables,
3-9 letters), so a BPE tokenizer counts about 1-2 tokens per word; the whitespace rule is the
one the emulator guarantees exactly.

Everything about a query's documents (ids, titles, sizes, words, scores) comes from a generator
seeded by (service seed, query), so the same seed and query give the same bytes in any process.
"""

from __future__ import annotations

import hashlib
import json
import threading

import cachetools
import numpy as np

_SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ne",
    "ru",
    "sa",
    "ti",
    "vo",
    "de",
    "ba",
    "po",
    "li",
    "ma",
    "to",
    "re",
    "en",
    "an",
    "or",
    "is",
    "al",
    "ta",
    "ri",
    "no",
    "se",
    "co",
    "ha",
    "ve",
    "lu",
    "di",
    "pe",
]


def _vocabulary() -> list[str]:
    rng = np.random.default_rng(20250929)
    words: set[str] = set()
    while len(words) < 4096:
        n = int(rng.integers(2, 4))
        words.add("".join(_SYLLABLES[i] for i in rng.integers(0, len(_SYLLABLES), n)))
    return sorted(words)


VOCAB = np.array(_vocabulary())
TOKENS_PER_DOC_FALLBACK = 168  # PolyTrace search_r1: ~505 tokens per query for top-3


def count_tokens(text: str) -> int:
    """The emulator's token counting rule: whitespace-separated words."""
    return len(text.split())


def query_rng(seed: int, query: str, salt: str = "docs") -> np.random.Generator:
    # surrogatepass: JSON may carry a lone surrogate escape ("\ud800"), which strict UTF-8 refused
    # (a 500); every other string hashes to the same bytes as before
    key = f"{seed}\x00{salt}\x00{query}".encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(key, digest_size=16).digest()
    return np.random.default_rng(list(np.frombuffer(digest, dtype=np.uint32)))


def split_tokens(rng: np.random.Generator, total: int, k: int) -> list[int]:
    """Split `total` tokens over k documents (roughly even, never below 2 each), summing exactly."""
    if k == 1:
        return [max(2, total)]
    floor = 2
    spare = max(0, total - floor * k)
    shares = rng.dirichlet(np.full(k, 8.0)) * spare
    sizes = np.floor(shares).astype(int)
    for i in np.argsort(shares - sizes)[::-1][: spare - int(sizes.sum())]:
        sizes[i] += 1
    return [int(s) + floor for s in sizes]


def make_document(rng: np.random.Generator, tokens: int) -> dict[str, str]:
    n_title = min(int(rng.integers(1, 4)), tokens - 1)
    words = VOCAB[rng.integers(0, VOCAB.size, tokens)]
    title = " ".join(w.capitalize() for w in words[:n_title])
    body = " ".join(words[n_title:])
    return {"id": str(int(rng.integers(0, 21_000_000))), "contents": f'"{title}"\n{body}'}


def synthetic_results(seed: int, query: str, topk: int, tokens: int) -> list[dict]:
    """Top-k scored documents for a query, `tokens` words in all."""
    rng = query_rng(seed, query)
    sizes = split_tokens(rng, tokens, topk)
    docs = [make_document(rng, n) for n in sizes]
    scores = 90.0 - np.cumsum(rng.exponential(2.0, topk))
    return [{"document": d, "score": round(float(s), 4)} for d, s in zip(docs, scores, strict=True)]


class DocumentCache:
    """Serialized result lists by (query, topk, tokens, scores): a repeated query costs a lookup.

    Bounded by count and by bytes: an entry is charged at least `max_bytes / size`, so at most
    `size` entries and `max_bytes` in all are kept (a count alone let 8,192 unique queries at
    200,000 tokens each hold about 11 GB). Locked: big replies are built on worker threads.
    """

    def __init__(self, seed: int, size: int, max_bytes: int) -> None:
        self.seed = seed
        if size and max_bytes:
            least = max(1, max_bytes // size)
            store: cachetools.LRUCache = cachetools.LRUCache(
                max_bytes, getsizeof=lambda data: max(len(data), least)
            )
            self._get = cachetools.cached(store, lock=threading.Lock())(self._render)
            self.store: cachetools.LRUCache | None = store
        else:
            self._get = self._render
            self.store = None

    def _render(self, query: str, topk: int, tokens: int, scores: bool) -> bytes:
        scored = synthetic_results(self.seed, query, topk, tokens)
        items = scored if scores else [s["document"] for s in scored]
        return json.dumps(items, separators=(",", ":")).encode()

    def get(self, query: str, topk: int, tokens: int, scores: bool) -> bytes:
        return self._get(query, topk, tokens, scores)
