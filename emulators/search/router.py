"""HTTP routes of the search emulator: Search-R1's `POST /retrieve` and the native call endpoint."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from toolenv_core.deadline import Deadline
from toolenv_core.fields import Integer, Number
from toolenv_core.headers import COUNT_MAX
from toolenv_core.latency.faults import SlowBodyFault
from toolenv_core.latency.samplers import Draw

from ..base import (
    begin_call,
    json_body_schema,
    play,
    unprocessable,
)
from ..fastpath import FastRouter
from .emulator import SearchEmulator


class RetrieveRequest(BaseModel):
    """Search-R1's request: several queries, top-k documents each."""

    queries: list[str] = Field(description="one result list per query")
    topk: Integer | None = Field(default=None, description="documents per query (default 3)")
    return_scores: bool = Field(
        default=False, description="wrap each document as {document, score}"
    )


class SearchCall(BaseModel):
    """The native call: one query or several, with exact-replay and sizing knobs."""

    model_config = ConfigDict(extra="forbid")

    query: str | None = None
    queries: list[str] | None = None
    topk: Integer | None = None
    return_scores: bool = False
    delay_s: Number | None = Field(
        default=None, ge=0, description="exact replay: sleep exactly this"
    )
    response_tokens: Integer | None = Field(
        default=None, ge=1, description="size the whole response to this"
    )
    step: Integer | None = Field(
        default=None, ge=0, le=COUNT_MAX, description="training step (for drifting profiles)"
    )


# Synthetic documents a reply may render on the event loop (about 0.1 ms each, uncached): a
# bigger one is built on a worker thread.
HEAVY_BODY_DOCUMENTS = 64


def _check(emulator: SearchEmulator, queries: list[str], topk: int | None) -> Response | int:
    s = emulator.settings
    if not queries:
        return unprocessable(["queries"], "give at least one query")
    if len(queries) > s.max_queries:
        return unprocessable(["queries"], f"at most {s.max_queries} queries per request")
    for i, q in enumerate(queries):
        if not q.strip():
            return unprocessable(["queries", i], "a query must not be blank")
        if len(q) > s.max_query_chars:
            return unprocessable(
                ["queries", i], f"a query may have at most {s.max_query_chars} characters"
            )
    k = s.default_topk if topk is None else topk
    if not 1 <= k <= s.max_topk:
        return unprocessable(["topk"], f"topk must be between 1 and {s.max_topk}, got {k}")
    return k


def build_router(emulator: SearchEmulator) -> APIRouter:
    router = FastRouter(tags=["search emulator"])
    settings = emulator.settings

    async def answer(
        deadline: Deadline,
        queries: list[str],
        topk: int,
        scores: bool,
        draw: Draw,
        arrival: float,
        response_tokens: int | None,
        native: bool,
        request: Request,
    ) -> Response:
        min_delay = 0.0
        # the answers with a body: a slow one is the same answer trickled (with a corpus, it
        # was made of synthetic documents); an error, hang or throttle sends none
        with_body = draw.fault is None or isinstance(draw.fault, SlowBodyFault)
        results = None
        if emulator.corpus is not None and with_body:
            results = await emulator.retrieve_real(queries, topk, scores)
            min_delay = time.monotonic() - arrival  # delay = max(real, sampled)

        def body() -> bytes:  # a heavy one on a worker thread, its sizes drawn there too
            budgets = None
            if results is not None:
                payload = results
            else:
                budgets = emulator.split_budget(queries, topk, response_tokens)
                payload = emulator.synthetic(queries, topk, budgets, scores)
            if not native:
                return b'{"result":' + payload + b"}"
            # the meta fields written straight (json.dumps was a tenth of a native call's CPU)
            tokens = b"null" if budgets is None else b"[%s]" % b",".join(b"%d" % n for n in budgets)
            return b'{"result":%s,"tool":"search","topk":%d,"response_tokens":%s}' % (
                payload,
                topk,
                tokens,
            )

        heavy = results is None and len(queries) * topk > HEAVY_BODY_DOCUMENTS
        return await play(
            arrival,
            draw,
            deadline,
            settings,
            body,
            emulator.pacer,
            min_delay,
            request.receive,
            heavy_body=heavy,
        )

    async def retrieve(request: Request) -> Response:
        """`{"queries": [...], "topk": 3, "return_scores": false}` -> `{"result": [[doc, ...], ...]}`."""
        start = await begin_call(request, settings, RetrieveRequest)
        if isinstance(start, Response):
            return start
        arrival, deadline, step, call = start
        checked = _check(emulator, call.queries, call.topk)
        if isinstance(checked, Response):
            return checked
        draw = emulator.draw(step)
        return await answer(
            deadline, call.queries, checked, call.return_scores, draw, arrival, None, False, request
        )

    async def call(request: Request) -> Response:
        """One query (`query`) or several (`queries`); `delay_s` replays a delay exactly,
        `response_tokens` sizes the response (whitespace words, split evenly over the queries)."""
        start = await begin_call(request, settings, SearchCall)
        if isinstance(start, Response):
            return start
        arrival, deadline, header_step, body = start
        if (body.query is None) == (body.queries is None):
            return unprocessable(["query"], "give exactly one of query or queries")
        queries = [body.query] if body.query is not None else list(body.queries or [])
        checked = _check(emulator, queries, body.topk)
        if isinstance(checked, Response):
            return checked
        if body.delay_s is not None and body.delay_s > settings.max_delay_s:
            return unprocessable(["delay_s"], f"at most {settings.max_delay_s} s")
        if body.response_tokens is not None:
            if body.response_tokens > settings.max_response_tokens:
                return unprocessable(["response_tokens"], f"at most {settings.max_response_tokens}")
            if body.response_tokens < 2 * checked * len(queries):
                return unprocessable(
                    ["response_tokens"], f"at least {2 * checked * len(queries)} (2 per document)"
                )
        step = body.step if body.step is not None else header_step
        # Exact replay: the caller's delay, no sampled delay and no fault.
        draw = emulator.exact(body.delay_s) if body.delay_s is not None else emulator.draw(step)
        return await answer(
            deadline,
            queries,
            checked,
            body.return_scores,
            draw,
            arrival,
            body.response_tokens,
            True,
            request,
        )

    router.add_fast_route(
        "POST",
        "/retrieve",
        retrieve,
        summary="Search-R1 compatible retrieval",
        openapi_extra=json_body_schema(RetrieveRequest),
    )
    router.add_fast_route(
        "POST",
        "/v1/emulators/search/call",
        call,
        summary="Native search call",
        openapi_extra=json_body_schema(SearchCall),
    )
    return router
