"""Synthetic trajectories drawn from the intern_s1 fitted parameters.

The document (`enhanced_task_distribution_parameters.json`, read by
`toolenv_core.polytrace.read_fitted_parameters`) gives the distribution of the number of calls per
tool-calling session and, per call count k, a Gaussian over the per-call lengths
`input_1..k` and `output_1..k`. We read a session of k calls as k model turns: turn i generates
`output_i` tokens; the prompt is `input_1`; after every turn but the last a tool call appends
`input_{i+1}` tokens (its response) to the context. Draws are clipped to at least 1 token, and
the same `LengthScale` as replay applies. Tool latency comes from the gateway's emulator.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from toolenv_core.polytrace.fitted import read_fitted_parameters

from .plan import ToolCallPlan, TrajectoryPlan, TurnPlan
from .replay import LengthScale


def synthetic_plans(
    path: str | Path,
    n: int,
    *,
    scale: LengthScale = LengthScale(),
    seed: int = 0,
    tool: str = "search",
    topk: int = 3,
) -> Iterator[TrajectoryPlan]:
    params = read_fitted_parameters(path)
    task = params.tool_calling_task
    probs = task.call_count_probabilities()
    counts = np.array(list(probs))
    weights = np.array([probs[c] for c in counts])
    rng = np.random.default_rng(seed)
    for i in range(n):
        k = int(rng.choice(counts, p=weights / weights.sum()))
        model = task.sequence_models[k]
        draw = rng.multivariate_normal(model.mean_vector, model.covariance_matrix)
        values = dict(zip(model.feature_names, draw, strict=True))
        inputs = [max(1, round(values[f"input_{j}"])) for j in range(1, k + 1)]
        outputs = [max(1, round(values[f"output_{j}"])) for j in range(1, k + 1)]
        tid = f"synthetic-{seed}-{i}"
        turns = []
        for j in range(k):
            calls = []
            if j < k - 1:
                append = scale.append(inputs[j + 1])
                args: dict = {"query": f"synthetic {tid} turn {j}", "topk": topk}
                if append > 0:  # as in replay: the emulator takes 1 or more
                    args["response_tokens"] = append
                calls.append(ToolCallPlan(tool, args, append, query_count=1))
            turns.append(
                TurnPlan(scale.output(outputs[j]), calls, "tool_calls" if calls else "stop")
            )
        yield TrajectoryPlan(
            tid, scale.prompt(inputs[0]), turns, source={"synthetic_seed": seed, "index": i}
        )
