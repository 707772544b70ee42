"""Fit the simulator's cost model from a real engine (`toolenv rollout calibrate`).

For every prompt length and batch size of the plan it sends that many concurrent requests with
fresh random prompts (no prefix-cache hits) and forced output lengths, and measures from the
token stream: time to first token (prefill, from batch 1 at each prompt length) and time per
decode iteration ((last token - first token) / (tokens - 1)). A least-squares fit gives
`decode_base_s + decode_per_seq_s * batch + decode_per_ctx_token_s * context_tokens` and the
prefill slope; negative coefficients (noise) are clipped to zero.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

import numpy as np

from .engines.base import Engine, EngineUnreachable, Generation
from .engines.costmodel import CostModel
from .workloads.plan import TokenSynth


@dataclass
class CalibrationPlan:
    batches: list[int] = field(default_factory=lambda: [1, 4, 16])
    prompt_lens: list[int] = field(default_factory=lambda: [64, 512])
    decode_tokens: int = 32
    repeats: int = 1

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1:
            raise ValueError("--batches needs positive batch sizes")
        if not self.prompt_lens or min(self.prompt_lens) < 1:
            raise ValueError("--prompt-lens needs positive lengths")
        if self.decode_tokens < 4:
            raise ValueError("--decode-tokens must be at least 4 to time decode iterations")

    def underdetermined(self) -> str | None:
        """Why a fit on these batches alone cannot tell its costs apart (None: it can). With one
        prompt length a batch's context grows with its size, so the cost per sequence and per
        context token are one column; with one batch size, the base and the cost per sequence
        are: least squares put it all on one term with a 0% fit error (costs known, a batch of
        16 at 4,000-token prompts came out 2-100x off)."""
        if len(set(self.batches)) < 2 or len(set(self.prompt_lens)) < 2:
            return (
                "--batches and --prompt-lens need two different values each (got "
                f"{','.join(map(str, self.batches))} x {','.join(map(str, self.prompt_lens))}): "
                "with one, the fit cannot tell the cost per sequence from the cost per context "
                "token or per iteration"
            )
        return None


@dataclass
class Sample:
    batch: int
    prompt_len: int
    ttft_s: float
    iteration_s: float


async def measure(engine: Engine, plan: CalibrationPlan, vocab_size: int) -> list[Sample]:
    synth = TokenSynth(vocab_size=vocab_size)
    counter = itertools.count()
    samples: list[Sample] = []

    async def one(prompt_len: int) -> Generation:
        n = next(counter)
        prompt = synth.ids(f"calibrate-{n}", prompt_len)
        try:
            return await engine.generate(
                f"calibrate-{n}",
                prompt,
                max_tokens=plan.decode_tokens,
                min_tokens=plan.decode_tokens,
                ignore_eos=True,
            )
        except EngineUnreachable:
            raise
        except Exception as exc:  # vLLM's VLLMValidationError, a server's 400: a traceback, exit 1
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(
                f"the engine refused a calibration request of {prompt_len} prompt tokens and "
                f"{plan.decode_tokens} to generate (--prompt-lens, --decode-tokens): {why}"
            ) from exc

    await one(min(plan.prompt_lens))  # warm-up: first-request costs are not the model's
    for _ in range(plan.repeats):
        for prompt_len in plan.prompt_lens:
            for batch in plan.batches:
                gens = await asyncio.gather(*(one(prompt_len) for _ in range(batch)))
                for g in gens:
                    if len(g.token_ids) > 1 and g.first_token_at is not None:
                        samples.append(
                            Sample(
                                batch, prompt_len, g.queue_s, g.decode_s / (len(g.token_ids) - 1)
                            )
                        )
    return samples


def fit(
    samples: list[Sample],
    decode_tokens: int,
    *,
    name: str,
    source: str,
    max_batch: int,
    block_size: int,
) -> CostModel:
    if not samples:
        raise ValueError("no measurements to fit")
    batch = np.array([s.batch for s in samples], float)
    context = np.array([s.batch * (s.prompt_len + decode_tokens / 2) for s in samples], float)
    iteration = np.array([s.iteration_s for s in samples], float)
    design = np.c_[np.ones_like(batch), batch, context]
    coef, *_ = np.linalg.lstsq(design, iteration, rcond=None)
    base, per_seq, per_ctx = (max(0.0, float(c)) for c in coef)
    if base == 0.0:
        base = float(np.min(iteration))
    single = [s for s in samples if s.batch == 1]
    prefill = 0.0
    if len({s.prompt_len for s in single}) >= 2:
        lens = np.array([s.prompt_len for s in single], float)
        ttft = np.array([s.ttft_s for s in single], float)
        slope, _ = np.polyfit(lens, ttft, 1)
        prefill = max(0.0, float(slope))
    elif single:
        prefill = single[0].ttft_s / single[0].prompt_len
    return CostModel(
        name=name,
        source=source,
        prefill_per_token_s=prefill,
        decode_base_s=base,
        decode_per_seq_s=per_seq,
        decode_per_ctx_token_s=per_ctx,
        max_batch=max_batch,
        block_size=block_size,
    )


def profile_from(
    engine: Engine, plan: CalibrationPlan, samples: list[Sample], name: str
) -> CostModel:
    """The fitted profile for what `measure` saw on `engine`, with its fit error."""
    block = engine.block_size
    cost = fit(
        samples,
        plan.decode_tokens,
        name=name,
        source=f"toolenv rollout calibrate --engine {engine.name}: {len(samples)} requests, "
        f"batches {plan.batches}, prompt lengths {plan.prompt_lens}",
        max_batch=engine.monitor.capacity,
        block_size=block,
    )
    return cost.model_copy(
        update={
            "fit_error": fit_error(cost, samples, plan.decode_tokens),
            "prefill_budget_tokens": engine.prefill_budget_tokens,
        }
    )


def fit_error(cost: CostModel, samples: list[Sample], decode_tokens: int) -> dict[str, float]:
    """How far the fitted model is from what was measured (relative, over every request)."""
    measured = np.array([s.iteration_s for s in samples], float)
    predicted = np.array(
        [
            cost.iteration_s(s.batch, int(s.batch * (s.prompt_len + decode_tokens / 2)), 0)
            for s in samples
        ]
    )
    rel = np.abs(predicted - measured) / measured
    ss_res = float(np.sum((measured - predicted) ** 2))
    ss_tot = float(np.sum((measured - measured.mean()) ** 2)) or 1e-12
    return {
        "iteration_mean_abs_rel_error": round(float(rel.mean()), 4),
        "iteration_p90_abs_rel_error": round(float(np.percentile(rel, 90)), 4),
        "iteration_r2": round(1 - ss_res / ss_tot, 4),
        "samples": len(samples),
    }


async def calibrate_engine(
    engine: Engine, plan: CalibrationPlan, *, name: str, vocab_size: int
) -> CostModel:
    await engine.start()
    try:
        samples = await measure(engine, plan, vocab_size)
    finally:
        await engine.close()
    return profile_from(engine, plan, samples, name)
