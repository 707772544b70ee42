"""The `openai` engine reads a completion stream as Server-Sent Events, against a local server
that streams what vLLM streams (one `data: {json}` line per chunk)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from testkit import LoopbackHTTP, QuietHandler

from rollout_client.engines import OpenAIEngine

# What a random-weight model's byte-level tokens decode to now and then: line breaks that JSON
# leaves unescaped (NEL, LINE SEPARATOR, PARAGRAPH SEPARATOR), and SSE does not break lines at.
TEXTS = ["ab", "c\x85d", "e\u2028f", "g\u2029h"]


def _chunk(text: str, ids: list[int], finish: str | None) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish, "token_ids": ids}
    body = {"id": "cmpl-1", "object": "text_completion", "choices": [choice]}
    return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"


# What vLLM's server streams when generation fails after the stream began (its engine died, or
# a request finished with reason "error"), before its `[DONE]`.
ERROR_EVENT = b'data: {"error": {"message": "EngineCore encountered an issue", "code": 400}}\n\n'


class _Completions(QuietHandler):
    """`/v1/models` lists one model; `/v1/completions` streams one chunk per text of TEXTS, or,
    at `/broken/v1/completions`, the first chunk and then an error event, or at
    `/cut/v1/completions` the first two chunks and no more (no finish reason, no `[DONE]`)."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.reply(200, b'{"object": "list", "data": [{"id": "m"}]}')

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        chunks = [
            _chunk(text, [2 * i, 2 * i + 1], "length" if i == len(TEXTS) - 1 else None)
            for i, text in enumerate(TEXTS)
        ]
        if self.path.startswith("/broken/"):
            chunks = [chunks[0], ERROR_EVENT]
        if self.path.startswith("/cut/"):  # a proxy's idle timeout, a server dying cleanly
            self.reply(200, b"".join(chunks[:2]), "text/event-stream; charset=utf-8")
            return
        body = b"".join(chunks) + b"data: [DONE]\n\n"
        self.reply(200, body, "text/event-stream; charset=utf-8")


@pytest.fixture
def server_url() -> Iterator[str]:
    with LoopbackHTTP(_Completions) as server:
        yield server.url


async def test_a_chunk_whose_text_holds_a_unicode_line_break_is_one_event(server_url) -> None:
    """The stream was split with httpx's `aiter_lines`, which breaks at every Unicode line
    boundary: a chunk whose text held U+2028 or U+0085 (JSON leaves them as they are) was cut in
    two, and its trajectory failed with "JSONDecodeError: Unterminated string" (1 of 32 in a
    replay on the tiny model). SSE breaks lines at CR and LF alone."""
    engine = OpenAIEngine([server_url])
    await engine.start()
    try:
        gen = await engine.generate("r", [1, 2, 3], max_tokens=8, min_tokens=8, ignore_eos=True)
    finally:
        await engine.close()
    assert gen.token_ids == list(range(8)) and gen.finish_reason == "length"


async def _failure(url: str) -> str:
    """What generating 8 forced tokens from `url` fails with (it must fail)."""
    engine = OpenAIEngine([url])
    await engine.start()
    try:
        with pytest.raises(RuntimeError) as caught:
            await engine.generate("r", [1, 2, 3], max_tokens=8, min_tokens=8, ignore_eos=True)
    finally:
        await engine.close()
    return str(caught.value)


async def test_an_error_event_mid_stream_fails_the_request(server_url) -> None:
    """vLLM's server reports a failure after the stream began as a `data: {"error": ...}` event
    and ends the stream as usual; the engine skipped it as a chunk without choices, so the turn
    ended early with the tokens made so far (2 of 8 forced) and its trajectory counted as done."""
    assert await _failure(server_url + "/broken") == (
        f"{server_url}/broken failed the request mid-stream: EngineCore encountered an issue"
    )


async def test_a_stream_that_ends_before_a_finish_reason_fails_the_request(server_url) -> None:
    """A stream closed after 2 of 4 chunks (no finish reason, no `[DONE]`) was taken for a turn
    that had finished short, with 4 of the 8 forced tokens, and its trajectory went on."""
    assert await _failure(server_url + "/cut") == (
        f"{server_url}/cut ended the stream before the answer finished (no finish_reason)"
    )
