"""Optional real retrieval: BM25 (bm25s) over a user's JSONL corpus.

Each line is `{"id", "contents"}` (Search-R1's own corpus shape: `"Title"\nbody`) or
`{"id", "title", "text"}`. The index is built once at start-up, off the event loop.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from toolenv_core.polytrace.errors import TraceFormatError


def _contents(raw: dict, path: Path, lineno: int) -> str:
    if isinstance(raw.get("contents"), str):
        return raw["contents"]
    if isinstance(raw.get("text"), str):
        title = raw.get("title") or ""
        return f'"{title}"\n{raw["text"]}'
    raise TraceFormatError(
        path, lineno, "contents", "each line needs `contents` or `title` + `text` strings"
    )


def read_corpus(path: Path) -> list[dict[str, str]]:
    """The corpus's documents, checked line by line (raises TraceFormatError naming the line):
    read when the app is built, so a bad corpus is a settings error before the server starts."""
    docs: list[dict[str, str]] = []
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(path, lineno, "", f"not valid JSON ({exc.msg})") from exc
            if not isinstance(raw, dict):
                raise TraceFormatError(path, lineno, "", "expected a JSON object")
            doc_id = str(raw.get("id", len(docs)))
            docs.append({"id": doc_id, "contents": _contents(raw, path, lineno)})
    if not docs:
        raise TraceFormatError(path, 0, "", "the corpus is empty")
    if not any(_indexed_words(d["contents"]) for d in docs):
        raise TraceFormatError(
            path,
            0,
            "",
            f"none of its {len(docs)} document(s) has a word BM25 indexes (2 or more letters or "
            "digits, not an English stopword)",
        )
    return docs


def _indexed_words(text: str) -> list[str]:
    """The words BM25 indexes in `text`, by bm25s's own rules (the ones `Bm25Corpus` uses). A
    corpus with none at all failed inside bm25s at start-up: a traceback and exit 3."""
    import bm25s  # about 0.8 s: loaded only when a corpus is configured

    return bm25s.tokenize([text], return_ids=False, show_progress=False)[0]


class Bm25Corpus:
    """The BM25 index over documents already read (`read_corpus`); built at start-up."""

    def __init__(self, docs: list[dict[str, str]]) -> None:
        import bm25s  # about 0.8 s: loaded only when a corpus is configured

        self.docs = docs
        self._bm25s = bm25s
        self.retriever = bm25s.BM25()
        self.retriever.index(
            bm25s.tokenize([d["contents"] for d in self.docs], show_progress=False),
            show_progress=False,
        )

    def __len__(self) -> int:
        return len(self.docs)

    def search(self, queries: list[str], topk: int) -> list[list[dict]]:
        """Top-k documents per query with BM25 scores (blocking: run it in a worker thread)."""
        k = min(topk, len(self.docs))
        tokens = self._bm25s.tokenize(queries, show_progress=False)
        indices, scores = self.retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        out = []
        for row_i, row_s in zip(np.atleast_2d(indices), np.atleast_2d(scores), strict=True):
            out.append(
                [
                    {"document": self.docs[int(i)], "score": round(float(s), 4)}
                    for i, s in zip(row_i, row_s, strict=True)
                ]
            )
        return out
