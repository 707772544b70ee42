"""The workloads a rollout replays: recorded plans and their scaling, synthetic plans from fitted
parameters, token synthesis, and traces or parameters that cannot be read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollout_client.session import build_plans
from rollout_client.settings import RolloutSettings
from rollout_client.workloads.plan import TokenSynth
from rollout_client.workloads.replay import LengthScale, replay_plans
from rollout_client.workloads.synthetic import synthetic_plans
from toolenv_core.polytrace import TraceFormatError, read_multiturn


def test_replay_plan_matches_the_record_and_scales(polytrace_dir: Path) -> None:
    path = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    record = next(read_multiturn(path))
    [plan] = list(replay_plans([path], limit=1, exact=True))
    assert plan.prompt_len == record.prompt_len
    assert [t.output_tokens for t in plan.turns] == [t.completion_tokens for t in record.turns]
    call = plan.turns[0].calls[0]
    assert call.append_tokens == record.tool_calls[0].append_len
    assert call.arguments["delay_s"] == record.tool_calls[0].latency_s
    assert (
        len(call.arguments.get("queries", [call.arguments.get("query")]))
        == record.tool_calls[0].query_count
    )
    [small] = list(
        replay_plans([path], limit=1, scale=LengthScale(0.1, max_output=5, max_append=50))
    )
    assert small.prompt_len == -(-record.prompt_len // 10)
    assert all(1 <= t.output_tokens <= 5 for t in small.turns)
    assert small.turns[0].calls[0].append_tokens == 50
    assert "delay_s" not in small.turns[0].calls[0].arguments
    sampled = list(replay_plans([path], sample=0.01, seed=1))
    assert 5 < len(sampled) < 60  # about 20 of 2,048


def test_a_length_scaled_to_a_whole_number_is_not_rounded_past_it() -> None:
    """Lengths are rounded up, and 100 x 1.1 is 110.00000000000001 in floating point: the prompt
    was 111 tokens. Up to 1e-6 of a token is floating-point error, not a part of a token."""
    scale = LengthScale(1.1)
    assert [scale.prompt(n) for n in (50, 100, 101)] == [55, 110, 112]
    assert [scale.output(n) for n in (90, 200)] == [99, 220]
    assert LengthScale(1.1, max_append=1000).append(110) == 121


def test_token_synth_is_deterministic_and_inside_the_vocabulary() -> None:
    synth = TokenSynth(vocab_size=1024)
    ids = synth.ids("x", 500)
    assert ids == synth.ids("x", 500) and ids != synth.ids("y", 500)
    assert min(ids) >= 16 and max(ids) < 1024


def test_synthetic_plans_follow_the_fitted_call_counts(polytrace_dir: Path) -> None:
    params = polytrace_dir / "intern_s1" / "enhanced_task_distribution_parameters.json"
    plans = list(synthetic_plans(params, 300, seed=3))
    counts = [len(p.turns) for p in plans]
    assert set(counts) <= set(range(1, 11))
    assert 0.3 < counts.count(3) / len(counts) < 0.56  # 43% of sessions make 3 calls
    assert all(len(p.turns[-1].calls) == 0 for p in plans)
    assert all(t.output_tokens >= 1 for p in plans for t in p.turns)


def test_synthetic_draws_what_an_over_sampling_policy_launches(polytrace_dir: Path) -> None:
    """`--synthetic` drew 2 x --batch a step: `--overlap-ratio 2` (3 x --batch a step) launched 8
    of 12, with a note blaming the trace size. It draws what the steps launch, bounded."""
    params = polytrace_dir / "intern_s1" / "enhanced_task_distribution_parameters.json"
    over = RolloutSettings(batch=4, steps=2, policy="async+overlap", overlap_ratio=2)
    assert len(list(build_plans(over, [], synthetic=params))) == 24
    assert len(list(build_plans(RolloutSettings(batch=4), [], synthetic=params))) == 4
    huge = over.model_copy(update={"batch": 5000, "overlap_ratio": 100})
    with pytest.raises(ValueError, match=r"draw 1,010,000 trajectories .*--limit N"):
        build_plans(huge, [], synthetic=params)
    limited = huge.model_copy(update={"limit": 5})
    assert len(list(build_plans(limited, [], synthetic=params))) == 5


def test_a_malformed_trace_names_file_line_and_field(tmp_path: Path, polytrace_dir: Path) -> None:
    good = (polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl").open().readline()
    bad = json.loads(good)
    del bad["turns"][0]["completion_tokens"]
    path = tmp_path / "bad.jsonl"
    path.write_text(good + json.dumps(bad) + "\n")
    with pytest.raises(TraceFormatError) as info:
        list(replay_plans([path]))
    assert info.value.line == 2 and info.value.field == "turns.0.completion_tokens"
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("where", "value", "said"),
    [
        ("turns.0.engine_latency_s", float("nan"), "Input should be a finite number"),
        ("turns.0.engine_latency_s", -5.0, "Input should be greater than or equal to 0"),
        ("tool_calls.0.latency_s", float("inf"), "Input should be a finite number"),
    ],
)
def test_a_latency_that_is_not_a_finite_duration_names_file_line_and_field(
    tmp_path: Path, polytrace_dir: Path, where: str, value: float, said: str
) -> None:
    """`validate` printed `nan%` accuracy for a NaN engine latency and replayed a negative one."""
    good = (polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl").open().readline()
    bad = json.loads(good)
    group, index, field = where.split(".")
    bad[group][int(index)][field] = value
    path = tmp_path / "bad.jsonl"
    path.write_text(good + json.dumps(bad) + "\n")  # json writes NaN / Infinity, as Python reads
    with pytest.raises(TraceFormatError) as info:
        list(replay_plans([path]))
    assert (info.value.line, info.value.field) == (2, where)
    assert said in str(info.value)


def _intern_s1_with(polytrace_dir: Path, tmp_path: Path, change) -> Path:
    doc = json.loads(
        (polytrace_dir / "intern_s1" / "enhanced_task_distribution_parameters.json").read_text()
    )
    change(doc["tool_calling_task"])
    path = tmp_path / "params.json"
    path.write_text(json.dumps(doc, indent=2))
    return path


def _rename_input_2(task: dict) -> None:
    names = task["sequence_models"]["3"]["feature_names"]
    names[names.index("input_2")] = "renamed"


@pytest.mark.parametrize(
    ("change", "field", "said"),
    [
        (  # was a ZeroDivisionError
            lambda t: t.update(call_count_distribution={"3": 0}),
            "tool_calling_task.call_count_distribution",
            "counts no sessions",
        ),
        (  # was numpy's "a cannot be empty unless no samples are taken"
            lambda t: t.update(call_count_distribution={}),
            "tool_calling_task.call_count_distribution",
            "counts no sessions",
        ),
        (  # was numpy's "Probabilities are not non-negative"
            lambda t: t["call_count_distribution"].update({"3": -5}),
            "tool_calling_task.call_count_distribution.3",
            "greater than or equal to 0",
        ),
        (  # was a KeyError: 3
            lambda t: t["sequence_models"].pop("3"),
            "tool_calling_task.sequence_models",
            "has no model for 3 calls",
        ),
        (  # was "cannot convert float NaN to integer"
            lambda t: t["sequence_models"]["3"]["mean_vector"].__setitem__(0, float("nan")),
            "tool_calling_task.sequence_models.3.mean_vector.0",
            "finite number",
        ),
        (  # was a KeyError: 'input_2'
            _rename_input_2,
            "tool_calling_task.sequence_models.3.feature_names",
            "lacks input_2 for 3 calls",
        ),
    ],
)
def test_fitted_parameters_that_cannot_be_drawn_from_name_the_field(
    polytrace_dir: Path, tmp_path: Path, change, field: str, said: str
) -> None:
    path = _intern_s1_with(polytrace_dir, tmp_path, change)
    with pytest.raises(TraceFormatError) as info:
        list(synthetic_plans(path, 8))
    assert info.value.field == field and said in str(info.value)
