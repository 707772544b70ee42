"""The engine's iterations, read off its token stream, and the cost model fitted on them.

A continuous-batching engine hands every running request its new tokens at the end of each
iteration, so chunks that reach the client within a fraction of a millisecond of each other
came out of one iteration. `StreamLog` wraps a real engine and keeps every chunk's arrival time;
`iterations` groups them back into iterations and rebuilds each one's batch from what the
requests had made so far (a request's first chunk: its prefill, less what the prefix cache
held; later chunks: decode at its current length), and `fit_iterations` fits the cost model's
iteration formula to their durations (busy iterations first, then the wake-up cost). Fitted on a workload run under the
very conditions the model is checked in (same client, same policies, same machine load), it
measures what a microbenchmark of isolated batches cannot: what an iteration costs in a rollout.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import scipy

from toolenv_core.console import counted

from .clock import now
from .engines.base import Chunk, Engine, PrefixCacheStats
from .engines.costmodel import CostModel


@dataclass
class RequestLog:
    submitted: float
    prompt_len: int
    cached: int = 0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens)


class StreamLog(Engine):
    """Another engine, with every request's chunk arrival times kept (`requests`)."""

    def __init__(self, inner: Engine) -> None:
        super().__init__(capacity=inner.monitor.capacity)
        self.inner = inner
        self.name = inner.name
        self.block_size = inner.block_size
        self.prefill_budget_tokens = inner.prefill_budget_tokens
        self.vocab_size = inner.vocab_size
        self.requests: dict[str, RequestLog] = {}

    async def _raw_stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        min_tokens: int,
        ignore_eos: bool,
        route_key: str | None,
    ) -> AsyncIterator[Chunk]:
        log = self.requests[request_id] = RequestLog(now(), len(prompt_ids))
        async for chunk in self.inner._raw_stream(
            request_id, prompt_ids, max_tokens, min_tokens, ignore_eos, route_key
        ):
            if chunk.cached_tokens is not None:
                log.cached = chunk.cached_tokens
            if chunk.token_ids:
                log.chunks.append((now(), len(chunk.token_ids)))
            yield chunk

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    def _undelivered(self, request_id: str) -> list[int]:
        return self.inner._undelivered(request_id)

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def prefix_cache_stats(self) -> PrefixCacheStats | None:
        return await self.inner.prefix_cache_stats()


# Columns of `iterations`: duration, then the formula's terms.
DURATION, DECODING, CONTEXT, PREFILL_TOKENS, PREFILL_SEQS, WAKE, ARRIVALS = range(7)


def iterations(requests: dict[str, RequestLog], gap_s: float = 4e-4) -> np.ndarray:
    """One row per iteration: (duration, decoding sequences, their context tokens, prompt tokens
    prefilled, sequences prefilled, 1 if the engine sat idle before it, requests submitted while
    it ran). An iteration starts when the previous one ended, or, after the engine went idle,
    when its first request was submitted (so that one also carries the request's way in, and
    the requests submitted with it count as its wake-up, not as arrivals)."""
    events = sorted(
        (t, rid, n, k == 0) for rid, log in requests.items() for k, (t, n) in enumerate(log.chunks)
    )
    if not events:
        return np.zeros((0, 7))
    submitted = np.sort([log.submitted for log in requests.values()])
    groups: list[list[tuple[float, str, int, bool]]] = [[events[0]]]
    for event in events[1:]:
        if event[0] - groups[-1][-1][0] > gap_s:
            groups.append([])
        groups[-1].append(event)
    made = dict.fromkeys(requests, 0)
    rows = []
    prev: float | None = None
    for group in groups:
        ids = [e[1] for e in group]
        fresh = [rid for _, rid, _, first in group if first]
        decoding = [rid for _, rid, _, first in group if not first]
        earliest = min(requests[rid].submitted for rid in ids)
        woke = prev is None or earliest >= prev
        start = earliest if woke else prev
        end = group[-1][0]
        submitted_during = int(
            np.searchsorted(submitted, end, "right") - np.searchsorted(submitted, start, "right")
        )
        rows.append(
            (
                end - start,
                len(decoding),
                sum(requests[r].prompt_len + made[r] for r in decoding),
                sum(requests[r].prompt_len - requests[r].cached for r in fresh),
                len(fresh),
                float(woke),
                0 if woke else submitted_during,  # a wake-up's requests are not arrivals
            )
        )
        for _, rid, n, _ in group:
            made[rid] += n
        prev = end
    return np.asarray(rows, dtype=float)


def _design(rows: np.ndarray) -> np.ndarray:
    return np.c_[
        rows[:, DECODING] > 0,
        rows[:, DECODING],
        rows[:, CONTEXT],
        rows[:, PREFILL_TOKENS],
        rows[:, PREFILL_SEQS],
    ].astype(float)


def _least_squares(design: np.ndarray, durations: np.ndarray) -> np.ndarray:
    scale = np.maximum(design.max(axis=0), 1e-12)  # comparable columns for the solver
    return scipy.optimize.lsq_linear(design / scale, durations, bounds=(0, np.inf)).x / scale


def fit_iterations(runs: Sequence[np.ndarray], start: CostModel) -> CostModel:
    """The iteration formula fitted on the iterations of several runs, in three stages.

    1. Busy iterations during which no request was submitted fix the per-iteration costs
       (decode, prefill per token and per sequence): least squares, coefficients >= 0. A shared
       machine runs some calibration runs uniformly slower than others (every iteration of a
       run, not a few stalls), so each run gets a slowdown factor (its measured over fitted
       busy time) and the model takes the median run's: the shape is refitted on iterations
       divided by their run's factor, then scaled by the median factor.
    2. The cost of a request arriving at a busy engine is the median, over the busy iterations
       during which requests were submitted, of their residual per request. Fitted beside the
       others it would trade off against them (it did: sync's iterations, which never see an
       arrival, came out cheaper than they ran).
    3. The wake-up cost is the median residual of the first-after-idle iterations under those
       costs, so it cannot trade off against the prefill it wakes for, and one stalled wake-up
       does not move it.
    """
    runs = [r for r in runs if len(r)]
    rows = np.vstack(runs) if runs else np.zeros((0, 7))
    quiet_runs = [_quiet(r) for r in runs]
    quiet = np.vstack(quiet_runs) if runs else np.zeros((0, 7))
    arriving = rows[(rows[:, WAKE] == 0) & (rows[:, ARRIVALS] > 0)]
    woke = rows[rows[:, WAKE] == 1]
    if len(quiet) < 8 or not len(woke):
        raise ValueError(
            f"too few iterations to fit the cost model: {counted(len(rows), 'iteration')} "
            f"({len(woke)} after idle, {len(quiet)} busy without an arrival)"
        )
    design = _design(quiet)
    slowdown = np.ones(len(runs))
    # Alternate: the shape on rows divided by their run's slowdown, then each run's slowdown.
    for _ in range(3):
        norm = np.concatenate(
            [q[:, DURATION] / s for q, s in zip(quiet_runs, slowdown, strict=True)]
        )
        coef = _least_squares(design, norm)
        slowdown = np.array([_slowdown(q, coef) for q in quiet_runs])
    coef = coef * float(np.median(slowdown))
    arrival = 0.0
    if len(arriving):
        excess = (arriving[:, DURATION] - _design(arriving) @ coef) / arriving[:, ARRIVALS]
        arrival = max(0.0, float(np.median(excess)))
    wake = max(0.0, float(np.median(woke[:, DURATION] - _design(woke) @ coef)))
    base, per_seq, per_ctx, per_token, per_prefill = coef.tolist()
    predicted = _design(rows) @ coef + wake * rows[:, WAKE] + arrival * rows[:, ARRIVALS]
    measured = rows[:, DURATION]
    return start.model_copy(
        update={
            "decode_base_s": base,
            "decode_per_seq_s": per_seq,
            "decode_per_ctx_token_s": per_ctx,
            "prefill_per_token_s": per_token,
            "prefill_per_seq_s": per_prefill,
            "idle_wake_s": wake,
            "busy_arrival_s": arrival,
            "fit_error": {
                **(start.fit_error or {}),
                "workload_iterations": len(rows),
                "workload_arrival_iterations": len(arriving),
                "workload_iteration_mean_abs_rel_error": round(
                    float(np.mean(np.abs(predicted - measured) / np.maximum(measured, 1e-9))), 4
                ),
                "workload_busy_s_measured": round(float(measured.sum()), 4),
                "workload_busy_s_fitted": round(float(predicted.sum()), 4),
                "workload_run_slowdown_min": round(float(slowdown.min() / np.median(slowdown)), 4),
                "workload_run_slowdown_max": round(float(slowdown.max() / np.median(slowdown)), 4),
            },
        }
    )


def _quiet(run: np.ndarray) -> np.ndarray:
    """A run's busy iterations during which no request was submitted."""
    return run[(run[:, WAKE] == 0) & (run[:, ARRIVALS] == 0)]


def _slowdown(quiet: np.ndarray, coef: np.ndarray) -> float:
    """A run's measured over fitted time of its quiet iterations (1 for a run with none)."""
    fitted = float((_design(quiet) @ coef).sum())
    return float(quiet[:, DURATION].sum()) / fitted if fitted > 0 else 1.0
