"""Latency models: each draws from its own law, round-trips through JSON/YAML, drifts and faults."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import yaml
from pydantic import ValidationError
from scipy import stats

from toolenv_core.latency import (
    LATENCY_MODEL,
    Drift,
    Profile,
    ProfileError,
    load_profile,
    parse_profile,
    save_profile,
)
from toolenv_core.latency.samplers import DriftSampler, FunctionSampler

SPECS = [
    {"kind": "uniform", "low_s": 0.1, "high_s": 0.4},
    {"kind": "truncnormal", "mean_s": 0.2, "std_s": 0.3, "low_s": 0.0},
    {"kind": "truncnormal", "mean_s": 1.0, "std_s": 0.5, "low_s": 0.5, "high_s": 1.2},
    {"kind": "lognormal", "median_s": 0.17, "sigma": 1.2},
    {"kind": "gamma", "shape": 0.8, "scale_s": 0.5},
    {"kind": "exponential", "mean_s": 0.45},
    {"kind": "lomax", "shape": 2.5, "scale_s": 0.3},
    {"kind": "pareto", "shape": 3.0, "scale_s": 0.05},
    {"kind": "empirical", "quantiles": [[0, 0.02], [0.5, 0.17], [0.9, 1.4], [1, 3.8]]},
    {"kind": "empirical", "samples": [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2]},
    {
        "kind": "mixture",
        "components": [
            {"weight": 0.7, "model": {"kind": "lognormal", "median_s": 0.08, "sigma": 0.6}},
            {"weight": 0.3, "model": {"kind": "gamma", "shape": 4, "scale_s": 0.3}},
        ],
    },
    {
        "kind": "faulty",
        "model": {"kind": "lognormal", "median_s": 0.5, "sigma": 0.3},
        "faults": [{"type": "error", "rate": 0.2, "status": 500}],
    },
    # bounds far out in a tail: the normal CDF rounded to 0 or 1 there, and every draw was
    # infinite (`max_delay_s` per call) or pinned to `low_s`
    {"kind": "truncnormal", "mean_s": 0.05, "std_s": 0.005, "low_s": 0.2},
    {"kind": "truncnormal", "mean_s": 5.0, "std_s": 0.1, "low_s": 0.0, "high_s": 1.0},
]


@pytest.mark.parametrize("raw", SPECS, ids=[f"{s['kind']}-{i}" for i, s in enumerate(SPECS)])
def test_samples_follow_the_models_own_cdf(raw: dict) -> None:
    spec = LATENCY_MODEL.validate_python(raw)
    samples = spec.build().sample_many(np.random.default_rng(1234), 4000)
    assert (samples >= 0).all()
    # 4,000 draws: the 5% critical value is 0.0215; 0.035 leaves a wide, fixed-seed margin.
    assert stats.kstest(samples, spec.cdf).statistic < 0.035


@pytest.mark.parametrize("raw", SPECS, ids=[f"{s['kind']}-{i}" for i, s in enumerate(SPECS)])
def test_json_and_yaml_round_trip_give_the_same_draws(raw: dict) -> None:
    spec = LATENCY_MODEL.validate_python(raw)
    via_json = LATENCY_MODEL.validate_json(LATENCY_MODEL.dump_json(spec))
    via_yaml = LATENCY_MODEL.validate_python(
        yaml.safe_load(yaml.safe_dump(LATENCY_MODEL.dump_python(spec, mode="json")))
    )
    assert via_json == spec == via_yaml
    draws = [
        s.build().sample_many(np.random.default_rng(7), 50) for s in (spec, via_json, via_yaml)
    ]
    assert np.array_equal(draws[0], draws[1]) and np.array_equal(draws[0], draws[2])


def test_same_seed_same_sequence_other_seed_other_sequence() -> None:
    spec = LATENCY_MODEL.validate_python(SPECS[3])
    a = spec.build().sample_many(np.random.default_rng(5), 100)
    b = spec.build().sample_many(np.random.default_rng(5), 100)
    c = spec.build().sample_many(np.random.default_rng(6), 100)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_max_s_clips_heavy_tails() -> None:
    spec = LATENCY_MODEL.validate_python(
        {"kind": "lomax", "shape": 0.8, "scale_s": 1.0, "max_s": 5.0}
    )
    samples = spec.build().sample_many(np.random.default_rng(0), 5000)
    assert samples.max() == 5.0 and spec.cdf(np.array([5.0]))[0] == 1.0


def test_a_draw_past_the_float_range_saturates_instead_of_raising() -> None:
    """A lognormal with sigma 1e6 (a typo in a PUT profile) overflowed exp(): every call to the
    emulator was a 500 with a traceback. Such a draw is an unbounded delay, clipped like any."""
    wide = {"kind": "lognormal", "median_s": 0.1, "sigma": 1e6}
    samples = LATENCY_MODEL.validate_python(wide).build().sample_many(np.random.default_rng(0), 200)
    assert (samples >= 0).all() and (samples == np.inf).sum() > 50
    clipped = LATENCY_MODEL.validate_python({**wide, "max_s": 5.0}).build()
    samples = clipped.sample_many(np.random.default_rng(0), 200)
    assert samples.max() == 5.0 and (samples == 5.0).sum() > 50


def test_trace_replay_keeps_order_and_loops() -> None:
    spec = LATENCY_MODEL.validate_python({"kind": "trace", "values_s": [0.3, 0.1, 0.2], "start": 1})
    sampler = spec.build()
    rng = np.random.default_rng(0)
    assert [sampler.sample(rng) for _ in range(5)] == [0.1, 0.2, 0.3, 0.1, 0.2]


def test_trace_replay_from_polytrace_files(polytrace_dir) -> None:
    spec = LATENCY_MODEL.validate_python(
        {"kind": "trace", "paths": [str(polytrace_dir / "search_r1")], "tool": "search"}
    )
    sampler = spec.build()
    rng = np.random.default_rng(0)
    first = [sampler.sample(rng) for _ in range(3)]
    assert first[0] == pytest.approx(0.07405877113342285)
    assert len(set(first)) == 3


def test_drift_by_explicit_step_and_by_call_count() -> None:
    stage = lambda v: {"kind": "constant", "value_s": v}  # noqa: E731
    spec = LATENCY_MODEL.validate_python(
        {
            "kind": "drift",
            "by": "step",
            "calls_per_step": 3,
            "schedule": [
                {"start": 0, "model": stage(0.1)},
                {"start": 2, "model": stage(0.2)},
                {"start": 5, "model": stage(0.5)},
            ],
        }
    )
    rng = np.random.default_rng(0)
    s = spec.build()
    assert [s.sample(rng, step=k) for k in (0, 1, 2, 4, 5, 99)] == [0.1, 0.1, 0.2, 0.2, 0.5, 0.5]
    counted = spec.build()
    draws = [counted.sample(rng) for _ in range(18)]
    assert draws[:6] == [0.1] * 6 and draws[6:15] == [0.2] * 9 and draws[15:] == [0.5] * 3
    periodic = Drift.model_validate({**spec.model_dump(), "period": 6}).build()
    assert [periodic.sample(rng, step=k) for k in (5, 6, 8)] == [0.5, 0.1, 0.2]


def test_drift_by_time_switches_on_the_clock() -> None:
    now = [100.0]
    sampler = DriftSampler(
        "time",
        [0.0, 10.0],
        [FunctionSampler(lambda r: 1.0, None), FunctionSampler(lambda r: 2.0, None)],
        None,
        None,
        clock=lambda: now[0],
    )
    rng = np.random.default_rng(0)
    assert sampler.sample(rng) == 1.0
    now[0] = 109.9
    assert sampler.sample(rng) == 1.0
    now[0] = 110.0
    assert sampler.sample(rng) == 2.0
    real = LATENCY_MODEL.validate_python(
        {
            "kind": "drift",
            "by": "time",
            "schedule": [
                {"start": 0, "model": {"kind": "constant", "value_s": 1}},
                {"start": 0.2, "model": {"kind": "constant", "value_s": 2}},
            ],
        }
    ).build()
    assert real.sample(rng) == 1.0
    time.sleep(0.25)
    assert real.sample(rng) == 2.0


def test_faults_are_drawn_at_their_rates_and_keep_the_latency() -> None:
    spec = LATENCY_MODEL.validate_python(
        {
            "kind": "faulty",
            "model": {"kind": "exponential", "mean_s": 0.2},
            "faults": [
                {"type": "error", "rate": 0.10, "status": 503},
                {"type": "hang", "rate": 0.05},
                {"type": "throttle", "rate": 0.05, "retry_after_s": 2},
                {"type": "slow_body", "rate": 0.02, "duration_s": 0.5},
            ],
        }
    )
    sampler = spec.build()
    rng = np.random.default_rng(3)
    draws = [sampler.draw(rng) for _ in range(20000)]
    kinds = [d.fault.type if d.fault else None for d in draws]
    for kind, rate in (
        ("error", 0.10),
        ("hang", 0.05),
        ("throttle", 0.05),
        ("slow_body", 0.02),
        (None, 0.78),
    ):
        assert abs(kinds.count(kind) / len(draws) - rate) < 0.012, kind
    assert next(d.fault for d in draws if d.fault and d.fault.type == "error").status == 503
    delays = np.array([d.delay_s for d in draws])
    assert stats.kstest(delays, spec.cdf).statistic < 0.02


def test_faults_compose_inside_a_mixture_component() -> None:
    spec = LATENCY_MODEL.validate_python(
        {
            "kind": "mixture",
            "components": [
                {"weight": 1, "model": {"kind": "constant", "value_s": 0.1}},
                {
                    "weight": 1,
                    "model": {
                        "kind": "faulty",
                        "model": {"kind": "constant", "value_s": 0.9},
                        "faults": [{"type": "throttle", "rate": 1.0}],
                    },
                },
            ],
        }
    )
    sampler = spec.build()
    rng = np.random.default_rng(0)
    for d in (sampler.draw(rng) for _ in range(200)):
        assert (d.fault is None) == (d.delay_s == 0.1)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"kind": "lognormal", "median_s": 0.1, "sigma": -1}, "sigma"),
        ({"kind": "lognormal", "median_s": 0.1}, "sigma"),
        ({"kind": "empirical", "quantiles": [[0.1, 1], [1, 2]]}, "quantiles"),
        (
            {
                "kind": "drift",
                "schedule": [{"start": 1, "model": {"kind": "constant", "value_s": 1}}],
            },
            "schedule",
        ),
        (
            {
                "kind": "faulty",
                "model": {"kind": "constant", "value_s": 1},
                "faults": [{"type": "error", "rate": 0.7}, {"type": "hang", "rate": 0.7}],
            },
            "faults",
        ),
        (
            {
                "kind": "faulty",
                "model": {"kind": "constant", "value_s": 1},
                "faults": [{"type": "error", "rate": 0.1, "status": 200}],
            },
            "status",
        ),
        (
            {
                "kind": "faulty",
                "model": {"kind": "constant", "value_s": 1},
                "faults": [{"type": "throttle", "rate": 0.1, "retry_after_s": 1e300}],
            },
            "retry_after_s",  # it was sent as a 300-digit Retry-After header
        ),
        ({"kind": "weibull", "shape": 1}, ""),
    ],
)
def test_invalid_specs_name_the_field(raw: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        LATENCY_MODEL.validate_python(raw)
    locs = [".".join(map(str, e["loc"])) for e in info.value.errors()]
    assert any(field in loc for loc in locs), locs
    with pytest.raises(ProfileError, match="field 'model"):
        parse_profile({"tool": "search", "model": raw})


def test_an_empty_or_unparsable_profile_file_is_one_line(tmp_path) -> None:
    empty = tmp_path / "p.yaml"
    empty.write_text("")
    with pytest.raises(ProfileError, match="p.yaml: is empty"):  # was "field '': ..."
        load_profile(empty)
    bad = tmp_path / "q.yaml"
    bad.write_text("model: {kind: [\n")
    with pytest.raises(ProfileError) as caught:
        load_profile(bad)
    assert "\n" not in str(caught.value) and "(line 2, column 1)" in str(caught.value)
    for text, held in (("[1, 2]\n", "a list"), ("hello\n", "a single value")):
        other = tmp_path / "r.yaml"
        other.write_text(text)  # was "field '': Input should be a valid dictionary or instance..."
        with pytest.raises(ProfileError) as caught:
            load_profile(other)
        assert str(caught.value) == (
            f"{other}: holds {held}, not a profile (a mapping with at least `model:`)"
        )


def test_profile_files_round_trip(tmp_path) -> None:
    profile = Profile(
        tool="search",
        model=LATENCY_MODEL.validate_python(SPECS[10]),
        source="unit test",
        response_tokens=LATENCY_MODEL.validate_python({"kind": "constant", "value_s": 500}),
    )
    for name in ("p.yaml", "p.json"):
        path = save_profile(profile, tmp_path / name)
        assert load_profile(path) == profile
    assert json.loads((tmp_path / "p.json").read_text())["model"]["kind"] == "mixture"
    (tmp_path / "bad.yaml").write_text(
        "tool: search\nmodel:\n  kind: gamma\n  shape: 0\n  scale_s: 1\n"
    )
    with pytest.raises(ProfileError, match=r"bad.yaml: field 'model.gamma.shape'"):
        load_profile(tmp_path / "bad.yaml")


def test_config_value_and_profile_file_are_the_same_object(tmp_path) -> None:
    from emulators.app import build_emulators
    from emulators.settings import EmulatorSettings

    inline = {"tool": "search", "model": {"kind": "lognormal", "median_s": 0.2, "sigma": 0.5}}
    cfg = tmp_path / "toolenv.yaml"
    cfg.write_text(yaml.safe_dump({"emulators": {"seed": 3, "search_profile": inline}}))
    settings = EmulatorSettings.load(cfg)
    emulators = build_emulators(settings)
    assert emulators["search"].profile == parse_profile(inline)
    assert emulators["reward"].profile.source.startswith(
        "PolyTrace rllm_deepcoder/"
    )  # shipped default
    path = save_profile(parse_profile(inline), tmp_path / "p.yaml")
    from_file = build_emulators(EmulatorSettings(search_profile_file=path))
    assert from_file["search"].profile == emulators["search"].profile


def test_mixture_weights_near_the_float_maximum_still_mix() -> None:
    """Two weights of 1e308 summed to inf: every draw took the last component."""
    spec = {
        "kind": "mixture",
        "components": [
            {"weight": 1e308, "model": {"kind": "constant", "value_s": 1.0}},
            {"weight": 1e308, "model": {"kind": "constant", "value_s": 2.0}},
        ],
    }
    model = LATENCY_MODEL.validate_python(spec)
    draws = [model.build().sample(np.random.default_rng(seed)) for seed in range(200)]
    assert 60 < draws.count(1.0) < 140 and draws.count(1.0) + draws.count(2.0) == 200
    assert model.cdf(np.array([1.5]))[0] == pytest.approx(0.5)


def test_a_trace_given_for_a_profile_says_what_it_is(polytrace_dir, tmp_path) -> None:
    """A PolyTrace file given to `--profile` or `emulators describe` said "does not parse:
    expected '<document start>', but found '{'" (YAML's words for JSON lines) or, for one line
    or the intern_s1 parameters, "field 'model': Field required"."""
    step = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    one = tmp_path / "one.jsonl"
    one.write_text(step.read_text().splitlines()[0] + "\n")
    params = polytrace_dir / "intern_s1" / "enhanced_task_distribution_parameters.json"
    reward = polytrace_dir / "rllm_deepcoder" / "reward_timings_step_0.jsonl"
    capture = tmp_path / "capture.jsonl"  # a gateway capture, one line and two
    call = {"tool_name": "search", "latency_s": 0.2, "trajectory_id": "t1", "status": "success"}
    capture.write_text(json.dumps(call) + "\n")
    captures = tmp_path / "captures.jsonl"
    captures.write_text(2 * (json.dumps(call) + "\n"))
    converts = "a gateway trace capture: `toolenv gateway trace-to-multiturn CAPTURE OUT.jsonl`"
    for path, looks in [
        (capture, converts),
        (captures, converts),
        (step, "a multi-turn trace: `toolenv rollout run --trace` replays it"),
        (one, "a multi-turn trace: "),
        (params, "fitted intern_s1 parameters: `toolenv rollout run --synthetic` reads it"),
        (reward, "reward timings: `toolenv emulators fit --tool reward` reads it"),
    ]:
        with pytest.raises(ProfileError) as info:
            load_profile(path)
        assert str(info.value).startswith(f"{path}: not a latency profile: it looks like {looks}")
    broken = tmp_path / "broken.json"  # a JSON profile opens with a lone `{` line too
    broken.write_text('{\n  "tool": "search",\n  "model": {"kind": "constant", "value_s": 1,}\n}\n')
    with pytest.raises(ProfileError, match=r"broken.json: does not parse: Expecting property"):
        load_profile(broken)
