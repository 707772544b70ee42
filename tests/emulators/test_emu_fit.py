"""`toolenv emulators fit` on the real search trace and on gateway captures; shipped profiles."""

from __future__ import annotations

import json
import resource
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from scipy import stats
from typer.testing import CliRunner

from emulators.fit import build_profile, fit
from toolenv.cli import build_app
from toolenv_core.latency import load_profile
from toolenv_core.latency.faults import ErrorFault
from toolenv_core.latency.profile import shipped_profile_path
from toolenv_core.polytrace import tool_latencies
from toolenv_core.polytrace.latencies import LatencyObservation

app = build_app()

runner = CliRunner()


@pytest.fixture(scope="module")
def search_fit(polytrace_dir: Path, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("fit") / "search.yaml"
    result = runner.invoke(
        app,
        [
            "emulators",
            "fit",
            str(polytrace_dir / "search_r1"),
            "--tool",
            "search",
            "--out",
            str(out),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), out


def test_fit_on_the_search_trace_picks_the_empirical_table(search_fit) -> None:
    report, _ = search_fit
    # 25 calls of status "unknown" (no query run, answered in under 1 ms) are not fitted
    assert report["n"] == 10165
    assert report["statuses"] == {
        "fitted": 10165,
        "carried_as_faults": {},
        "left_out": {"unknown": 25},
    }
    by_name = {c["name"]: c for c in report["candidates"]}
    assert {
        "lognormal",
        "gamma",
        "exponential",
        "truncnormal",
        "lomax",
        "lognormal_mixture_2",
        "empirical_quantiles",
    } <= set(by_name)
    # The recorded latency is spread over two decades with a cut-off tail: no closed form passes.
    assert all(
        c["ks"] > report["ks_critical_5pct"] for c in report["candidates"] if c["parametric"]
    )
    assert report["best"] == "empirical_quantiles"
    best = by_name["empirical_quantiles"]
    assert best["ks"] < 0.005 and all(abs(e) < 0.01 for e in best["quantile_errors"].values())
    # Sanity of the scores: a 3-component lognormal mixture beats a single lognormal.
    assert by_name["lognormal_mixture_3"]["ks"] < by_name["lognormal"]["ks"]


def test_fit_writes_a_profile_that_reproduces_the_trace(search_fit, polytrace_dir: Path) -> None:
    _, out = search_fit
    profile = load_profile(out)
    assert profile.tool == "search" and profile.model.kind == "empirical"
    assert "search_r1/multiturn_workload_step_0.jsonl" in profile.source
    data = tool_latencies([polytrace_dir / "search_r1"])
    draws = profile.model.build().sample_many(np.random.default_rng(0), 50_000)
    for p in (0.5, 0.9, 0.99):
        assert abs(np.quantile(draws, p) / np.quantile(data, p) - 1) < 0.03
    tokens = profile.response_tokens.build().sample_many(np.random.default_rng(0), 5000)
    assert 480 < tokens.mean() < 530  # ~505 tokens per query for top-3 in the trace


def test_fit_picks_a_closed_form_when_the_data_follow_one() -> None:
    data = np.random.default_rng(11).lognormal(np.log(0.3), 0.5, 3000)
    report = fit(data)
    assert report.best.parametric and report.best.ks <= report.ks_critical
    lognormal = next(c for c in report.candidates if c.name == "lognormal")
    assert (
        abs(lognormal.spec.median_s / 0.3 - 1) < 0.05 and abs(lognormal.spec.sigma / 0.5 - 1) < 0.05
    )


def test_fit_human_report_and_errors(polytrace_dir: Path, tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["emulators", "fit", str(polytrace_dir / "rllm_deepcoder"), "--tool", "reward"]
    )
    assert result.exit_code == 0, result.output
    assert "chosen" in result.output and "KS" in result.output
    none = runner.invoke(
        app, ["emulators", "fit", str(polytrace_dir / "rllm_deepcoder"), "--tool", "search"]
    )
    assert none.exit_code == 2 and "no calls of tool 'search'" in none.output
    bad = tmp_path / "bad.log"
    bad.write_text("Step1, Request ID: a, Tool: search, Latency: soon seconds\n")
    result = runner.invoke(app, ["emulators", "fit", str(bad)])
    assert result.exit_code == 2 and "bad.log:1" in result.output and "latency" in result.output


def test_fit_of_a_tool_the_trace_lacks_names_the_tools_it_has(tmp_path: Path) -> None:
    """A misspelt --tool read as if the files were the wrong kind ("no calls of tool 'serch' in
    calls.log: 1 file(s) of a gateway call log ..."), without the names that would do."""
    calls = tmp_path / "calls.log"
    calls.write_text("Step0, Request ID: a, Tool: search, Latency: 0.2 seconds\n"
                     "Step0, Request ID: b, Tool: python, Latency: 1.5 seconds\n")  # fmt: skip
    result = runner.invoke(app, ["emulators", "fit", str(calls), "--tool", "serch"])
    assert result.exit_code == 2
    assert "the tools recorded there: python, search (--tool names one)" in result.stderr


def test_fit_to_a_profile_that_cannot_be_written_is_one_line_exit_2(tmp_path: Path) -> None:
    """Found before the traces are read and fitted: it was found after them, the report never
    printed, and a path under a file said "cannot write the profile to ...: File exists"."""
    calls = tmp_path / "calls.log"
    rng = np.random.default_rng(1)
    calls.write_text("".join(f"Step0, Request ID: {i}, Tool: search, Latency: {x:.4f} seconds\n"
                             for i, x in enumerate(rng.lognormal(-2, 1, 300))))  # fmt: skip
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out, said in [
        (blocker / "profile.yaml", f"{blocker} is a file, not a directory"),  # under a file
        (blocker / "d" / "profile.yaml", f"{blocker} is a file, not a directory"),
        (tmp_path, "is a directory; name a profile file (YAML or .json)"),
        (Path("/proc/profile.yaml"), "cannot write in /proc: "),  # root writes anywhere else
    ]:
        result = runner.invoke(app, ["emulators", "fit", str(calls), "--out", str(out)])
        assert result.exit_code == 2, (result.output, result.exception)
        assert result.stderr.startswith(f"error: --out {out}: {said}"), result.stderr
        assert result.stderr.count("\n") == 1 and result.stdout == "", result.output
    assert blocker.read_text() == "" and sorted(tmp_path.iterdir()) == [blocker, calls]


def test_shipped_profiles_name_their_source_and_match_the_published_facts() -> None:
    search = load_profile(shipped_profile_path("search_default"))
    assert (
        search.source.startswith("PolyTrace search_r1/")
        and search.fit["best"] == "empirical_quantiles"
    )
    draws = search.model.build().sample_many(np.random.default_rng(2), 100_000)
    # polytrace/README: median 0.17 s, p90 1.39 s, p99 2.92 s, max 3.77 s
    assert abs(np.median(draws) - 0.17) < 0.01 and abs(np.quantile(draws, 0.9) - 1.39) < 0.05
    assert abs(np.quantile(draws, 0.99) - 2.92) < 0.1 and draws.max() <= 3.78
    reward = load_profile(shipped_profile_path("reward_default"))
    assert reward.tool == "reward" and reward.reference["batch_size"] == 64
    rdraws = reward.model.build().sample_many(np.random.default_rng(2), 20_000)
    assert 60 < rdraws.mean() < 100


def test_per_step_drift_profile_switches_by_step() -> None:
    from emulators.fit import empirical_table, per_step_drift

    rng = np.random.default_rng(4)
    steps = np.repeat([0, 1, 2], 1000)
    data = np.concatenate(
        [rng.uniform(0.1, 0.2, 1000), rng.uniform(1.0, 2.0, 1000), rng.uniform(5, 6, 1000)]
    )
    drift = per_step_drift(steps, data)
    assert drift.by == "step" and drift.calls_per_step == 1000 and len(drift.schedule) == 3
    sampler = drift.build()
    for step, (lo, hi) in enumerate([(0.1, 0.2), (1.0, 2.0), (5, 6)]):
        draws = [sampler.sample(rng, step=step) for _ in range(200)]
        assert lo <= min(draws) and max(draws) <= hi
    table = empirical_table(data)
    assert table.quantiles[0] == (0.0, pytest.approx(data.min(), abs=1e-6))


def test_fit_on_a_gateway_capture_fits_successful_calls_and_carries_the_rest(
    tmp_path: Path,
) -> None:
    """Timeouts (cut at the 1 s deadline), errors (answered in 2 ms) and calls whose caller left
    were fitted alike with the successes: the fitted p90 was the deadline."""
    rng = np.random.default_rng(3)
    statuses = ["success"] * 300 + ["timeout"] * 40 + ["error"] * 20 + ["caller_gone"] * 10
    latency = {"timeout": 1.0, "error": 0.002, "caller_gone": 0.05}
    lines = [
        json.dumps(
            {
                "tool_name": "search",
                "turn": i % 3,
                "status": status,
                "response_bytes": 100,
                "latency_s": latency.get(status) or float(rng.lognormal(np.log(0.1), 0.4)),
                "trajectory_id": f"t{i // 3}",
                "step": 0,
            }
        )  # fmt: skip
        for i, status in enumerate(rng.permutation(statuses))
    ]
    capture = tmp_path / "capture.jsonl"
    capture.write_text("\n".join(lines) + "\n")
    trace = tmp_path / "trace.jsonl"
    converted = runner.invoke(app, ["gateway", "trace-to-multiturn", str(capture), str(trace)])
    assert converted.exit_code == 0, converted.output
    out = tmp_path / "profile.yaml"
    result = runner.invoke(app, ["emulators", "fit", str(trace), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["n"] == 300 and report["data_quantiles"]["max"] < 0.9
    assert report["data_quantiles"]["min"] > 0.002
    assert report["statuses"] == {
        "fitted": 300,
        "carried_as_faults": {"error": 20, "timeout": 40},
        "left_out": {"caller_gone": 10},
    }
    profile = load_profile(out)
    assert profile.model.kind == "faulty"
    faults = {f.type: f.rate for f in profile.model.faults}
    assert faults == {"error": round(20 / 360, 6), "hang": round(40 / 360, 6)}
    assert profile.fit["statuses"] == report["statuses"]
    human = runner.invoke(app, ["emulators", "fit", str(trace)])
    assert human.exit_code == 0, human.output
    said = " ".join(human.output.split())
    assert "latency fitted on 300 successful calls" in said
    assert "carried as faults: 20 error calls (error, rate 0.05556)" in said
    assert "40 timeout calls (hang, rate 0.1111)" in said
    assert "left out: 10 caller_gone calls" in said
    # describe compares the profile with what fit fitted, not with the timeouts and errors
    described = runner.invoke(
        app, ["emulators", "describe", str(out), "--data", str(trace), "--json"]
    )
    assert described.exit_code == 0, described.output
    assert json.loads(described.stdout)["data"]["n"] == 300


def test_fit_on_a_gateway_capture_itself_says_to_convert_it_first(tmp_path: Path) -> None:
    """Before: a trace capture given to `fit` as is was 'not a PolyTrace file this project
    reads', with no word of the command that makes one of it."""
    capture = tmp_path / "capture.jsonl"
    record = {"turn": 0, "tool_name": "search", "latency_s": 0.06, "status": "success"}
    capture.write_text(json.dumps(record | {"trajectory_id": "t1", "step": 0}) + "\n")
    result = runner.invoke(app, ["emulators", "fit", str(capture)])
    assert result.exit_code != 0
    said = " ".join(result.output.split())
    assert "gateway trace capture" in said and "toolenv gateway trace-to-multiturn" in said, said
    run = runner.invoke(
        app, ["rollout", "run", "--trace", str(capture), "--clock", "virtual", "--exact"]
    )
    assert run.exit_code != 0
    said = " ".join(run.output.split())
    assert "toolenv gateway trace-to-multiturn" in said, said


def test_degenerate_latencies_fit_without_scipy_warnings() -> None:
    """Latencies of 0 s (a logger that rounds) printed scipy's RuntimeWarnings, its source lines
    included, amid the report; the gamma fit that fails on them is reported in its row."""
    for data in ([0.0, 0.0, 0.1], [0.2, 0.2]):  # mostly 0 s; all alike
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = fit(np.array(data))
        assert [str(w.message) for w in caught] == [], data
        assert report.n == len(data) and report.best.spec is not None
        assert next(c for c in report.candidates if c.name == "gamma").error  # in its row


def test_the_ks_distance_counts_ties_and_the_tables_own_steps_right() -> None:
    """scipy's kstest assumes a continuous CDF: on latencies logged to 10 ms the empirical
    table, within 0.001 of the data, was reported at KS 0.12 (worse than every lognormal
    mixture), and calls that all took 0.5 s at KS 1.0 with "reproduces the recorded shape"."""
    rounded = np.round(np.random.default_rng(3).lognormal(np.log(0.17), 1.2, 5000), 2)
    table = next(c for c in fit(rounded).candidates if c.name == "empirical_quantiles")
    assert table.ks < 0.01
    same = fit(np.full(50, 0.5))
    assert same.best.name == "empirical_quantiles" and same.best.ks == 0.0
    assert same.reason.endswith("reproduces the recorded shape (KS 0.0000)")
    # a continuous model on data without ties: the distance scipy's test gives
    data = np.random.default_rng(4).gamma(0.8, 0.5, 2000)
    lognormal = next(c for c in fit(data).candidates if c.name == "lognormal")
    assert lognormal.ks == pytest.approx(stats.kstest(data, lognormal.spec.cdf).statistic)


def test_fit_json_stays_json_when_a_candidate_fails(tmp_path: Path) -> None:
    """Calls that all took 0.5 s: the gamma fit fails, its KS is inf, and `--json` printed
    `"ks": Infinity`, which is not JSON."""
    calls = tmp_path / "calls.log"
    calls.write_text(
        "".join(f"Step0, Request ID: {i}, Tool: search, Latency: 0.5 seconds\n" for i in range(50))
    )
    result = runner.invoke(app, ["emulators", "fit", str(calls), "--json"])
    assert result.exit_code == 0, result.output

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    rows = {c["name"]: c for c in json.loads(result.stdout, parse_constant=refuse)["candidates"]}
    assert rows["gamma"]["error"] and rows["gamma"]["ks"] is None


def test_a_profile_names_only_the_files_that_held_its_calls(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """`fit search_r1 rllm_deepcoder --tool reward` read its calls from the reward timings
    alone, and its profile's `source` named the search traces too."""
    out = tmp_path / "reward.yaml"
    traces = [str(polytrace_dir / "search_r1"), str(polytrace_dir / "rllm_deepcoder")]
    result = runner.invoke(
        app, ["emulators", "fit", *traces, "--tool", "reward", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    source = load_profile(out).source or ""
    assert "rllm_deepcoder/reward_timings_step_0.jsonl" in source and "search_r1" not in source


def test_a_per_step_fit_says_it_wrote_a_drift_not_the_chosen_candidate(tmp_path: Path) -> None:
    """`--per-step` writes one empirical stage per step, but its notes said "chose truncnormal"
    (the candidate of all steps pooled) and the report said nothing of the drift."""
    log = tmp_path / "calls.log"
    log.write_text(
        "".join(
            f"Step{i // 10}, Request ID: {i}, Tool: search, Latency: {0.1 + i / 100} seconds\n"
            for i in range(20)
        )
    )
    out = tmp_path / "drift.yaml"
    result = runner.invoke(app, ["emulators", "fit", str(log), "--per-step", "--out", str(out)])
    assert result.exit_code == 0, result.output
    profile = load_profile(out)
    assert profile.model.kind == "drift" and len(profile.model.schedule) == 2
    written = " ".join(result.output.split())  # rich wraps the long line
    assert "drift of 2 empirical stage(s), one per recorded step" in written
    as_json = runner.invoke(
        app, ["emulators", "fit", str(log), "--per-step", "--out", str(out), "--json"]
    )
    report = json.loads(as_json.stdout)
    assert report["profile_kind"] == "drift" and report["best"] != "empirical_quantiles"
    notes = profile.notes or ""
    assert f"chose {report['best']}" not in notes and "drift of 2 empirical stage(s)" in notes


def test_a_per_step_drift_counts_the_calls_its_faults_take_in_a_step() -> None:
    """The served drift counts every call, a fault too, but `calls_per_step` was the successful
    calls per step alone: with a quarter of the calls carried as errors, the emulator moved on
    to the next step's stage after three quarters of a recorded step."""
    rng = np.random.default_rng(5)
    ok = [
        LatencyObservation(step=s, trajectory=i, turn=0, latency_s=float(rng.uniform(0.1, 0.2)))
        for s in (0, 1)
        for i in range(300)
    ]
    report = fit(np.asarray([o.latency_s for o in ok]))
    faults = [ErrorFault(rate=0.25)]  # 200 errors among the 800 calls of the two steps
    profile = build_profile(report, source="t", observations=ok, per_step=True, faults=faults)
    assert profile.model.kind == "faulty" and profile.model.model.kind == "drift"
    assert profile.model.model.calls_per_step == 400


def test_the_shipped_reward_profile_is_what_the_documented_fit_writes(
    polytrace_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/cli.md: `reward_default.yaml` is `fit rllm_deepcoder --tool reward`'s output, its
    `fit` block (with the `statuses` every fit now records) included."""
    monkeypatch.setenv("TOOLENV_TRACES_CACHE_DIR", str(polytrace_dir))
    out = tmp_path / "reward.yaml"
    argv = ["emulators", "fit", "rllm_deepcoder", "--tool", "reward", "--out", str(out)]
    result = runner.invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert out.read_text() == shipped_profile_path("reward_default").read_text()


def _file_size_limit(limit: int) -> Callable[[], None]:
    def apply() -> None:  # a write past it fails with EFBIG, as a full disk fails with ENOSPC
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_profile_that_cannot_be_written_whole_leaves_the_one_there(tmp_path: Path) -> None:
    """`--out` on a full disk truncated the profile already there and left the part written:
    a refit of a profile in use destroyed it (`does not parse: ...`). Now the file stays as it
    was, and nothing else is left beside it."""
    calls = tmp_path / "calls.log"
    rng = np.random.default_rng(0)
    calls.write_text("".join(f"Step0, Request ID: {i}, Tool: search, Latency: {x:.6f} seconds\n"
                             for i, x in enumerate(rng.lognormal(-1.5, 1, 500))))  # fmt: skip
    out = tmp_path / "profile.yaml"
    out.write_text("model: {kind: constant, value_s: 0.25}\n")
    before = out.read_bytes()
    done = subprocess.run(
        [sys.executable, "-m", "toolenv", "emulators", "fit", str(calls), "--out", str(out)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_file_size_limit(64),
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.endswith(f"error: cannot write the profile to {out}: File too large\n")
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calls.log", "profile.yaml"]


def test_fit_out_onto_a_trace_it_reads_is_refused(polytrace_dir: Path, tmp_path: Path) -> None:
    """`fit T --out T` (or a file of a directory given) wrote the profile over the recorded
    trace, exit 0: the trace was lost."""
    trace = tmp_path / "traces" / "step_0.jsonl"
    trace.parent.mkdir()
    source = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    trace.write_text("".join(source.open().readlines()[:50]))
    before = trace.read_bytes()
    for given in (trace, trace.parent):
        result = runner.invoke(app, ["emulators", "fit", str(given), "--out", str(trace)])
        assert result.exit_code == 2, result.output
        said = f"error: --out {trace}: is the trace {trace} it reads; name another file\n"
        assert result.stderr == said
        assert trace.read_bytes() == before
