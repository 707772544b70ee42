"""The simulator's cost model: prefill cost per token and decode-iteration time.

    iteration_s = decode_base_s + decode_per_seq_s * batch + decode_per_ctx_token_s * context_tokens
                  + prefill_per_token_s * tokens_prefilled_this_iteration
                  + prefill_per_seq_s * sequences_prefilled_this_iteration
                  (+ idle_wake_s on the first iteration after the engine sat idle)
                  (+ busy_arrival_s per request that arrived while it was busy)

`context_tokens` is the sum of every running sequence's length (attention reads the whole KV
cache each iteration). Built-in profiles and where their numbers come from:

- `searchr1-qwen7b` (the whole Search-R1 deployment as one engine, fed by verl's SGLang
  multi-turn rollout). Fitted by `toolenv rollout validate --fit step_0 --fit step_1` on
  PolyTrace `search_r1/multiturn_workload_step_{0,1}.jsonl`: a Nelder-Mead search over
  (decode_base_s, decode_per_seq_s, prefill_per_token_s, max_batch) replaying both steps in
  virtual time, minimising makespan error + completion-time KS + half the turn p50/p90 error,
  started from a regression of turn 0's engine latency on its output length (intercept: the
  step's prompts prefilled; slope: one iteration at full batch). Reported on step 2, which the fit
  never saw: makespan 434.2 s against 435.4 s recorded (99.7%), completion-time KS 0.093, turn
  latency p50 90.0 s against 79.3 s and p90 176.4 s against 181.6 s. The fit put the batch limit
  above the step's 2,048 requests, where the data cannot tell values apart: it is set to 2,048.
  The engine model has changed since (commit be20718 fitted it): the same command now lands on
  another optimum (docs/rollout.md, "Against PolyTrace's own timings"); this one is kept so the
  study's figures stay those of one model.
- `vllm-cpu-tiny`: fitted by `toolenv rollout calibrate --engine vllm --model tiny-llama
  --batches 1,4,16 --prompt-lens 64,512 --decode-tokens 32` on this project's 2-core machine
  (shared with other work at the time, so on the slow side) with the tiny test model
  (random-weight Llama, 2 layers, hidden 128), block size 32: prefill 10.5 us/token, decode
  iteration 7.9 ms + 0.252 ms/sequence + 0.297 us/context token. A microbenchmark of isolated
  batches: no wake-up or per-sequence prefill term. `toolenv rollout calibrate --check TRACE`
  fits every term on the iterations of a rollout run on the engine (docs/rollout.md: on the
  same machine, waking from idle 11.9-13.5 ms).
`toolenv rollout calibrate` writes a profile of this shape to JSON; `--cost-profile FILE` loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from toolenv_core.config import did_you_mean
from toolenv_core.errors import first_problem
from toolenv_core.fields import Integer, Number
from toolenv_core.outputs import write_whole


class CostModel(BaseModel):
    # a misspelt key (`kv_capacity` for `kv_capacity_tokens`) was dropped: the run went on
    # without the limit it named
    model_config = ConfigDict(extra="forbid")

    name: str = "custom"
    source: str = ""
    prefill_per_token_s: Number = Field(ge=0)
    decode_base_s: Number = Field(ge=0)
    decode_per_seq_s: Number = Field(ge=0)
    decode_per_ctx_token_s: Number = Field(default=0.0, ge=0)
    max_batch: Integer = Field(default=256, ge=1, description="sequences decoded together at most")
    block_size: Integer = Field(default=16, ge=1, description="prefix-cache granularity (tokens)")
    kv_capacity_tokens: Integer | None = Field(
        default=None, ge=1, description="KV-cache size in tokens (None: never full)"
    )
    prefill_per_seq_s: Number = Field(
        default=0.0,
        ge=0,
        description="per sequence prefilled in an iteration, whatever its length (the engine's "
        "per-request set-up: block tables, input batch, first-token sampling)",
    )
    idle_wake_s: Number = Field(
        default=0.0,
        ge=0,
        description="added to the first iteration after the engine sat idle (its loop and worker "
        "threads waking; paid once per turn by a turn-synchronous rollout)",
    )
    busy_arrival_s: Number = Field(
        default=0.0,
        ge=0,
        description="added to the next iteration for each request that reached the engine while "
        "it was busy (vLLM's engine core takes it in while the batch runs; a turn-synchronous "
        "rollout submits to an idle engine and never pays it)",
    )
    prefill_budget_tokens: Integer = Field(
        default=8192, ge=1, description="prompt tokens prefilled per iteration at most"
    )
    request_latency_s: Number = Field(
        default=0.0,
        ge=0,
        description="per request, outside the batch: submit to scheduler and result to caller "
        "(API, IPC, detokenizing; what dominates a tiny model on a CPU)",
    )
    fit_error: dict[str, float] | None = Field(
        default=None, description="how far the fit is from what it was fitted on"
    )

    def iteration_s(
        self, batch: int, context_tokens: int, prefill_tokens: int, prefill_seqs: int = 0
    ) -> float:
        decode = 0.0
        if batch:
            decode = (
                self.decode_base_s
                + self.decode_per_seq_s * batch
                + self.decode_per_ctx_token_s * context_tokens
            )
        return (
            decode
            + self.prefill_per_token_s * prefill_tokens
            + self.prefill_per_seq_s * prefill_seqs
        )

    def save(self, path: str | Path) -> None:
        write_whole(Path(path), self.model_dump_json(indent=2) + "\n")


BUILTIN_PROFILES: dict[str, CostModel] = {
    "searchr1-qwen7b": CostModel(
        name="searchr1-qwen7b",
        source="toolenv rollout validate --fit search_r1 step 0 --fit step 1 (see "
        "rollout_client/engines/costmodel.py)",
        prefill_per_token_s=27.32e-6,
        decode_base_s=0.018006,
        decode_per_seq_s=0.00074893,
        decode_per_ctx_token_s=0.0,
        max_batch=2048,
        block_size=16,
        fit_error={
            "step2_makespan_accuracy": 0.9973,
            "step2_completion_ks": 0.0928,
            "fit_loss_steps_0_1": 0.1502,
        },
    ),
    "vllm-cpu-tiny": CostModel(
        name="vllm-cpu-tiny",
        source="toolenv rollout calibrate --engine vllm --batches 1,4,16 --prompt-lens 64,512 "
        "--decode-tokens 32, tiny test model, vllm-cpu 0.32, 2 shared cores (2026-11-22)",
        prefill_per_token_s=10.5e-6,
        decode_base_s=0.0079,
        decode_per_seq_s=0.000252,
        decode_per_ctx_token_s=0.297e-6,
        max_batch=64,
        block_size=32,
    ),
}


def load_cost_model(name_or_path: str) -> CostModel:
    """A built-in profile by name, or a JSON file written by `toolenv rollout calibrate`."""
    if name_or_path in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        known = ", ".join(sorted(BUILTIN_PROFILES))
        raise ValueError(
            f"cost profile {name_or_path!r} is neither a built-in ({known}) nor a file"
        )
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"cost profile {path} does not parse: {exc}") from exc
    if not isinstance(data, dict):  # it said "field '': ... a valid dictionary or instance of"
        held = "null" if data is None else "an array" if isinstance(data, list) else "a value"
        raise ValueError(
            f"cost profile {path}: holds {held}, not a JSON object of costs (as "
            "`toolenv rollout calibrate --out` writes)"
        )
    try:
        return CostModel.model_validate(data)
    except ValidationError as exc:
        field, msg = first_problem(exc)
        if exc.errors()[0]["type"] == "extra_forbidden":
            known = did_you_mean(field, CostModel.model_fields)
            raise ValueError(f"cost profile {path}: unknown field {field!r}{known}") from exc
        raise ValueError(f"cost profile {path}: field {field!r}: {msg}") from exc
