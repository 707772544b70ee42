"""PolyTrace readers: every published format, streaming, and errors that name file, line and field."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from toolenv_core.polytrace import (
    CallLogRecord,
    TraceFormatError,
    detect_format,
    iter_latencies,
    read_call_log,
    read_dapo_filter,
    read_fitted_parameters,
    read_multiturn,
    read_packed_lengths,
    read_reward_timings,
    tool_latencies,
    write_call_log,
    write_multiturn,
)


def test_packed_lengths_of_every_workload(polytrace_dir: Path) -> None:
    for workload, prompts_per_step in (
        ("verl_dapo", None),
        ("verl_video", None),
        ("rllm_deepcoder", None),
    ):
        files = sorted((polytrace_dir / workload).glob("packed_lengths_step_*.jsonl"))
        assert files, workload
        records = list(read_packed_lengths(files[0]))
        assert records and prompts_per_step is None
        for r in records:
            assert len(r.output) == r.n_sampling == 8
            assert r.input > 0 and all(n >= 0 for n in r.output)
    deepcoder = list(
        read_packed_lengths(polytrace_dir / "rllm_deepcoder" / "packed_lengths_step_0.jsonl")
    )
    assert max(max(r.output) for r in deepcoder) == 16000  # DeepCoder's 16k max response


def test_reward_timings_and_dapo_filter(polytrace_dir: Path) -> None:
    rows = [
        r
        for f in sorted((polytrace_dir / "rllm_deepcoder").glob("reward_timings_*.jsonl"))
        for r in read_reward_timings(f)
    ]
    assert len(rows) == 10
    assert all(r.batch_size == 64 for r in rows)
    assert 37 <= min(r.reward_time_s for r in rows) < max(r.reward_time_s for r in rows) <= 125
    assert all(abs(r.response_mean - r.response_sum / r.batch_size) < 1e-6 for r in rows)
    batches = list(read_dapo_filter(polytrace_dir / "verl_dapo" / "dapo_filter_indices.jsonl"))
    assert batches and all(len(b.kept_prompt_indices) == b.kept_prompt_count for b in batches)
    assert all(set(b.used_prompt_indices) <= set(b.kept_prompt_indices) for b in batches)


def test_fitted_parameters(polytrace_dir: Path) -> None:
    fitted = read_fitted_parameters(
        polytrace_dir / "intern_s1" / "enhanced_task_distribution_parameters.json"
    )
    probs = fitted.tool_calling_task.call_count_probabilities()
    assert abs(sum(probs.values()) - 1) < 1e-9
    assert max(probs, key=probs.get) == 3 and 0.42 < probs[3] < 0.44  # 43% of sessions make 3 calls
    seq = fitted.tool_calling_task.sequence_models[3]
    assert len(seq.feature_names) == seq.n_features == len(seq.mean_vector)
    gmm = fitted.math_task.gmm_parameters
    joint = gmm.sample(np.random.default_rng(0), 20000)
    assert joint.shape == (20000, 2)
    assert abs(joint[:, 1].mean() - 9575) / 9575 < 0.05  # mean output 9,575 tokens
    assert fitted.math_task.output_distribution.frozen().median() > 0


def test_latencies_in_replay_order(polytrace_dir: Path) -> None:
    obs = list(iter_latencies([polytrace_dir / "search_r1"], "search"))
    assert len(obs) == 10190
    assert [o.step for o in obs] == sorted(o.step for o in obs)
    first = json.loads(
        (polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl").open().readline()
    )
    assert obs[0].latency_s == first["tool_calls"][0]["latency_s"]
    values = tool_latencies([polytrace_dir / "search_r1"])
    assert abs(np.median(values) - 0.17) < 0.01 and abs(np.quantile(values, 0.99) - 2.92) < 0.05
    rewards = tool_latencies([polytrace_dir / "rllm_deepcoder"], "reward")
    assert rewards.size == 10
    assert detect_format(polytrace_dir / "verl_dapo" / "dapo_filter_indices.jsonl") == "dapo_filter"
    assert (
        detect_format(polytrace_dir / "intern_s1" / "enhanced_task_distribution_parameters.json")
        == "fitted_parameters"
    )


def test_call_log_round_trip_with_other_log_lines(tmp_path: Path) -> None:
    records = [
        CallLogRecord(step=s, request_id=f"req-{s}-{i}", tool="search", latency_s=0.1 * i)
        for s in range(2)
        for i in range(3)
    ]
    buf = io.StringIO()
    assert write_call_log(records, buf) == 6
    log = tmp_path / "calls.log"
    lines = buf.getvalue().splitlines()
    log.write_text(
        "INFO starting\n"
        + "\n".join(f"2025-09-01 12:00:0{i} INFO {line}" for i, line in enumerate(lines))
        + "\n"
    )
    back = list(read_call_log(log))
    assert back == records
    assert detect_format(log) == "call_log"
    assert list(tool_latencies([log], "search")) == [r.latency_s for r in records]


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("Step1, Request ID: abc, Tool: search, Latency: fast seconds", "latency"),
        ("Step1, Request ID: abc, Tool: search, Latency: -1 seconds", "latency"),
        ("Stepx, Request ID: abc, Tool: search, Latency: 0.5 seconds", "step"),
        ("Step1, Request ID: abc, Latency: 0.5 seconds", "tool"),
        ("Step1, Request ID: , Tool: search, Latency: 0.5 seconds", "request_id"),
    ],
)
def test_call_log_malformed_names_the_field(tmp_path: Path, line: str, field: str) -> None:
    log = tmp_path / "bad.log"
    log.write_text("Step0, Request ID: ok, Tool: search, Latency: 0.1 seconds\n" + line + "\n")
    reader = read_call_log(log)
    assert next(reader).request_id == "ok"
    with pytest.raises(TraceFormatError) as info:
        next(reader)
    assert (info.value.path, info.value.line, info.value.field) == (str(log), 2, field)
    assert f"{log}:2" in str(info.value)


GOOD = {
    "packed": (
        '{"step":0,"rank":0,"dp_rank":0,"tp_rank":0,"local_index":0,"input":5,"output":[1,2],"n_sampling":2}',
        read_packed_lengths,
    ),
    "reward": (
        '{"step":0,"rank":0,"dp_rank":0,"tp_rank":0,"batch_size":64,"reward_time_s":3.5,"response_sum":10,"response_mean":0.2,"response_max":3}',
        read_reward_timings,
    ),
    "dapo": (
        '{"workload_step":0,"trainer_step":1,"gen_batch_index":1,"prompt_count":4,"n_sampling":8,"train_batch_size":2,"num_prompt_in_batch_before":0,"kept_prompt_count":2,"used_prompt_count":2,"kept_prompt_indices":[0,3],"used_prompt_indices":[0,3]}',
        read_dapo_filter,
    ),
    "multiturn": (
        '{"step":0,"prompt_len":3,"turns":[{"turn":0,"prompt_tokens":3,"completion_tokens":4,"finish_reason":"stop"}],"tool_calls":[{"turn":0,"tool_name":"search","latency_s":0.2}]}',
        read_multiturn,
    ),
}


@pytest.mark.parametrize(
    ("fmt", "patch", "field"),
    [
        ("packed", {"output": [1, -2]}, "output"),
        ("packed", {"input": "many"}, "input"),
        ("reward", {"reward_time_s": -1}, "reward_time_s"),
        ("reward", {"batch_size": None}, "batch_size"),
        ("dapo", {"kept_prompt_indices": [0, 9]}, "kept_prompt_indices"),
        ("dapo", {"kept_prompt_count": 3}, "kept_prompt_indices"),
        (
            "multiturn",
            {
                "turns": [
                    {
                        "turn": 0,
                        "prompt_tokens": -3,
                        "completion_tokens": 4,
                        "finish_reason": "stop",
                    }
                ]
            },
            "turns.0.prompt_tokens",
        ),
        (
            "multiturn",
            {"tool_calls": [{"turn": 0, "tool_name": "search"}]},
            "tool_calls.0.latency_s",
        ),
    ],
)
def test_jsonl_readers_name_file_line_and_field(
    tmp_path: Path, fmt: str, patch: dict, field: str
) -> None:
    good, reader = GOOD[fmt]
    bad = json.dumps({**json.loads(good), **patch})
    path = tmp_path / f"{fmt}.jsonl"
    path.write_text(good + "\n\n" + good + "\n" + bad + "\n")
    stream = reader(path)
    assert (
        len([next(stream), next(stream)]) == 2
    )  # streamed: good records arrive before the bad line is read
    with pytest.raises(TraceFormatError) as info:
        next(stream)
    assert info.value.line == 4 and info.value.field == field and info.value.path == str(path)
    assert str(path) in str(info.value) and field in str(info.value)


def test_not_json_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text(GOOD["reward"][0] + "\n{oops\n")
    with pytest.raises(TraceFormatError, match=r"x.jsonl:2: not valid JSON"):
        list(read_reward_timings(path))
    with pytest.raises(TraceFormatError, match="cannot open"):
        list(read_packed_lengths(tmp_path / "absent.jsonl"))


def test_fitted_parameters_malformed_names_line_and_field(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    doc = json.loads(
        (polytrace_dir / "intern_s1" / "enhanced_task_distribution_parameters.json").read_text()
    )
    doc["tool_calling_task"]["sequence_models"]["2"]["mean_vector"] = [1.0]
    path = tmp_path / "fitted.json"
    text = json.dumps(doc, indent=2)
    path.write_text(text)
    with pytest.raises(TraceFormatError) as info:
        read_fitted_parameters(path)
    assert info.value.field == "tool_calling_task.sequence_models.2.mean_vector"
    assert text.splitlines()[info.value.line - 1].strip().startswith('"mean_vector"')
    path.write_text(text[:500])
    with pytest.raises(TraceFormatError, match="not valid JSON"):
        read_fitted_parameters(path)


def test_multiturn_write_read_round_trip(polytrace_dir: Path, tmp_path: Path) -> None:
    src = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    records = []
    for r in read_multiturn(src):
        records.append(r)
        if len(records) == 50:
            break
    out = tmp_path / "copy.jsonl"
    with out.open("w") as f:
        assert write_multiturn(records, f) == 50
    again = list(read_multiturn(out))
    assert [r.model_dump() for r in again] == [r.model_dump() for r in records]
    first_src = json.loads(src.open().readline())
    first_copy = json.loads(out.open().readline())
    assert (
        first_copy["response_loss_mask_rle"] == first_src["response_loss_mask_rle"]
    )  # extra fields kept
