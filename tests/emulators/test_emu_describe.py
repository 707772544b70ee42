"""`toolenv emulators describe`: a profile's quantiles, faults and drift stages, as text, JSON and a PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.figure
import matplotlib.pyplot
import numpy as np
import pytest
from typer.testing import CliRunner

from emulators.describe import plot_cdf
from toolenv.cli import build_app
from toolenv_core.latency import load_profile
from toolenv_core.latency.profile import shipped_profile_path

app = build_app()

runner = CliRunner()


def test_describe_prints_quantiles_and_writes_a_png(polytrace_dir: Path, tmp_path: Path) -> None:
    png = tmp_path / "cdf.png"
    shipped = shipped_profile_path("search_default")
    result = runner.invoke(
        app,
        [
            "emulators",
            "describe",
            str(shipped),
            "--data",
            str(polytrace_dir / "search_r1"),
            "--plot",
            str(png),
            "--samples",
            "20000",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert report["ks_model_vs_data"] < 0.02
    assert all(abs(report["relative_error"][q]) < 0.03 for q in ("p50", "p90", "p99"))
    human = runner.invoke(app, ["emulators", "describe", str(shipped), "--samples", "5000"])
    assert human.exit_code == 0 and "p99" in human.output
    missing = runner.invoke(app, ["emulators", "describe", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "nope.yaml" in missing.output


def test_describe_plot_writes_the_file_it_names(tmp_path: Path) -> None:
    """`--plot cdf` wrote `cdf.png` and reported `cdf`; `--plot DIR` wrote `DIR.png`, exit 0."""
    shipped = str(shipped_profile_path("search_default"))
    plain = tmp_path / "cdf"
    result = runner.invoke(app, ["emulators", "describe", shipped, "--plot", str(plain)])
    assert result.exit_code == 0, result.output
    assert plain.read_bytes()[:4] == b"\x89PNG" and not (tmp_path / "cdf.png").exists()
    # rich read `[v2]` as a markup tag: it wrote cdf[v2].png and said `plot written to cdf.png`
    tagged = tmp_path / "cdf[v2].png"
    result = runner.invoke(app, ["emulators", "describe", shipped, "--plot", str(tagged)])
    assert result.exit_code == 0 and tagged.exists(), result.output
    assert f"plot written to {tagged}\n" in result.stdout, result.stdout
    folder = tmp_path / "plots"
    folder.mkdir()
    result = runner.invoke(app, ["emulators", "describe", shipped, "--plot", str(folder)])
    assert result.exit_code == 2 and not (tmp_path / "plots.png").exists()
    said = f"error: cannot write the plot to {folder}: is a directory; name a PNG file\n"
    assert result.stderr == said  # said before the sampling
    negative = runner.invoke(app, ["emulators", "describe", shipped, "--seed", "-1"])
    assert (
        negative.exit_code == 2 and "--seed" in negative.output
    )  # "expected non-negative integer"


def test_describe_says_what_share_of_calls_a_profiles_faults_take(tmp_path: Path) -> None:
    """Before: `describe` of a profile `fit` wrote from a capture with errors and timeouts showed
    its latency only: nothing said that one call in nine hangs."""
    out = tmp_path / "faulty.yaml"
    faults = _described_faults(
        out,
        "  model: {kind: lognormal, median_s: 0.1, sigma: 0.3}\n"
        "  faults:\n"
        "  - {type: error, rate: 0.055556, status: 503}\n"
        "  - {type: hang, rate: 0.111111}\n",
    )
    assert faults == [
        {"type": "error", "rate": 0.055556, "status": 503},
        {"type": "hang", "rate": 0.111111},
    ]
    human = runner.invoke(app, ["emulators", "describe", str(out)])
    assert human.exit_code == 0, human.output
    said = " ".join(human.output.split())
    assert "faults: error (HTTP 503) on 5.556% of calls, hang on 11.11%" in said, said


def test_describe_plot_under_a_file_says_so(tmp_path: Path) -> None:
    """`--plot FILE/cdf.png` said "cannot write the plot to ...: File exists" (the directories
    it makes for the plot met the file)."""
    shipped = str(shipped_profile_path("search_default"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for plot in (blocker / "cdf.png", blocker / "d" / "cdf.png"):
        result = runner.invoke(app, ["emulators", "describe", shipped, "--plot", str(plot)])
        assert result.exit_code == 2, (result.output, result.exception)
        assert result.stderr == (
            f"error: cannot write the plot to {plot}: {blocker} is a file, not a directory\n"
        )
    assert blocker.read_text() == "" and sorted(tmp_path.iterdir()) == [blocker]


def test_describe_shows_each_stage_of_a_drift(tmp_path: Path) -> None:
    """A sample of a drift by time (drawn at once) or by step without calls_per_step is all
    its first stage: describe printed that stage's quantiles as the profile's, and the later
    stages appeared nowhere."""
    stages = [
        {"start": 0, "model": {"kind": "constant", "value_s": 0.1}},
        {"start": 30, "model": {"kind": "constant", "value_s": 2.0}},
    ]
    path = tmp_path / "drift.json"
    path.write_text(json.dumps({"model": {"kind": "drift", "by": "time", "schedule": stages}}))
    result = runner.invoke(app, ["emulators", "describe", str(path), "--json"])
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)["stages"]
    assert [(s["start"], s["by"], s["p50"], s["max"]) for s in got] == [
        (0, "time", 0.1, 0.1),
        (30, "time", 2.0, 2.0),
    ]
    human = runner.invoke(app, ["emulators", "describe", str(path)])
    assert human.exit_code == 0, human.output
    assert "from 0 s (s)" in human.stdout and "from 30 s (s)" in human.stdout


def test_describe_of_draws_past_the_float_range_says_inf_and_stays_json(tmp_path: Path) -> None:
    """A lognormal with sigma 1000 draws inf: its quantiles were numpy's nan (inf - inf) with
    a RuntimeWarning on stderr, and `--json` printed NaN and Infinity, which are not JSON."""
    path = tmp_path / "wide.json"
    path.write_text(json.dumps({"model": {"kind": "lognormal", "median_s": 0.1, "sigma": 1000}}))
    result = runner.invoke(app, ["emulators", "describe", str(path), "--json"])
    assert result.exit_code == 0, result.output

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    model = json.loads(result.stdout, parse_constant=refuse)["model"]
    assert model["p50"] < 1 and model["p99"] is None and model["max"] is None
    human = runner.invoke(app, ["emulators", "describe", str(path)])
    assert human.exit_code == 0 and "nan" not in human.stdout and "inf" in human.stdout
    assert "RuntimeWarning" not in human.stderr, human.stderr


def test_describe_names_the_faults_within_a_drift_stage_or_a_mixture(tmp_path: Path) -> None:
    """Only a top-level `faulty` model's faults were reported: a drift stage that fails half of
    its calls was described as if nothing failed."""
    out = tmp_path / "nested.yaml"
    out.write_text(
        "tool: search\n"
        "model:\n"
        "  kind: drift\n"
        "  schedule:\n"
        "  - start: 0\n"
        "    model:\n"
        "      kind: faulty\n"
        "      model: {kind: constant, value_s: 0.1}\n"
        "      faults: [{type: error, rate: 0.5, status: 500}]\n"
        "  - start: 2\n"
        "    model:\n"
        "      kind: mixture\n"
        "      components:\n"
        "      - {weight: 3, model: {kind: constant, value_s: 0.2}}\n"
        "      - weight: 1\n"
        "        model:\n"
        "          kind: faulty\n"
        "          model: {kind: constant, value_s: 0.3}\n"
        "          faults: [{type: hang, rate: 0.2}]\n"
    )
    described = runner.invoke(app, ["emulators", "describe", str(out), "--json"])
    assert described.exit_code == 0, described.output
    assert json.loads(described.stdout)["faults"] == [
        {"type": "error", "rate": 0.5, "status": 500, "where": "the drift stage from step 0"},
        {
            "type": "hang",
            "rate": 0.2,
            "where": "the drift stage from step 2, mixture component 2 (weight 0.25)",
        },
    ]
    human = runner.invoke(app, ["emulators", "describe", str(out)])
    said = " ".join(human.output.split())
    assert (
        "faults: in the drift stage from step 0: error (HTTP 500) on 50% of its calls; in the "
        "drift stage from step 2, mixture component 2 (weight 0.25): hang on 20% of its calls"
    ) in said, said


def test_data_without_the_profiles_tool_names_what_chooses_it_not_a_missing_option(
    tmp_path: Path,
) -> None:
    """`describe` and a `trace` profile have no `--tool`, yet a trace without the tool's calls
    ended in "(--tool names one)": the profile's `tool` chooses them there."""
    calls = tmp_path / "calls.log"
    calls.write_text("Step0, Request ID: a, Tool: search, Latency: 0.2 seconds\n")
    reward = shipped_profile_path("reward_default")
    result = runner.invoke(app, ["emulators", "describe", str(reward), "--data", str(calls)])
    assert result.exit_code == 2
    assert result.stderr.rstrip().endswith(
        "the tools recorded there: search (the profile's `tool` names one)"
    ), result.stderr
    replay = tmp_path / "replay.yaml"
    replay.write_text(f"model: {{kind: trace, paths: ['{calls}'], tool: serch}}\n")
    result = runner.invoke(app, ["emulators", "describe", str(replay)])
    assert result.exit_code == 2
    assert result.stderr.rstrip().endswith(
        "the tools recorded there: search (the trace model's `tool` names one)"
    ), result.stderr


def test_describe_plot_draws_a_one_call_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--data` of one call: the trace's CDF was drawn with `step` through its one point, which
    draws nothing; the legend said `trace (n=1)` over an empty curve."""
    drawn: list[matplotlib.figure.Figure] = []
    monkeypatch.setattr(matplotlib.pyplot, "close", drawn.append)
    profile = load_profile(shipped_profile_path("search_default"))
    plot_cdf(profile, np.array([0.07]), tmp_path / "cdf.png", n=1000)
    [fig] = drawn
    [trace] = [line for line in fig.axes[0].get_lines() if line.get_label() == "trace (n=1)"]
    assert set(trace.get_xdata()) == {0.07} and set(trace.get_ydata()) == {0.0, 1.0}


def test_describe_plot_onto_what_it_reads_is_refused(tmp_path: Path) -> None:
    """`--plot` naming the profile (or a --data trace) wrote the PNG over it, exit 0."""
    profile = tmp_path / "p.yaml"
    profile.write_text(shipped_profile_path("search_default").read_text())
    before = profile.read_bytes()
    result = runner.invoke(app, ["emulators", "describe", str(profile), "--plot", str(profile)])
    assert result.exit_code == 2, result.output
    said = f"error: cannot write the plot to {profile}: it is {profile}, read here; name a PNG file"
    assert result.stderr == said + "\n"
    assert profile.read_bytes() == before


def test_a_shipped_profile_is_named_from_any_directory(tmp_path: Path) -> None:
    """Installed from a wheel, a user had no `emulators/profiles/search_default.yaml` to name:
    the shipped profiles were out of reach of `describe`, `--profile` and `--tool-profile`. A
    file of that name, where there is one, is still the file."""

    def describe(name: str) -> dict:
        done = subprocess.run(
            [sys.executable, "-m", "toolenv", "emulators", "describe", name, "--json"],
            cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    shipped = describe("search_default")
    assert shipped == describe(str(shipped_profile_path("search_default")))
    assert describe("reward_default") != shipped
    (tmp_path / "search_default").write_text("model: {kind: constant, value_s: 0.5}\n")
    assert describe("search_default") != shipped


def test_describe_says_an_inner_faults_rate_is_of_the_calls_the_outer_ones_spare(
    tmp_path: Path,
) -> None:
    """A fault drawn by an outer `faulty` replaces one drawn inside: an inner 50% of errors under
    a 50% of hangs fails 25% of the calls, and was described as "error on 50% of calls"."""
    out = tmp_path / "nested.yaml"
    faults = _described_faults(
        out,
        "  model:\n"
        "    kind: faulty\n"
        "    model: {kind: constant, value_s: 0.1}\n"
        "    faults: [{type: error, rate: 0.5, status: 503}]\n"
        "  faults: [{type: hang, rate: 0.5}]\n",
    )
    where = "the calls the outer faults spare (50%)"
    assert faults == [
        {"type": "hang", "rate": 0.5},
        {"type": "error", "rate": 0.5, "status": 503, "where": where},
    ]
    # what the emulator draws: half hangs, a quarter errors
    sampler = load_profile(out).model.build()
    rng = np.random.default_rng(0)
    kinds = [d.fault.type if d.fault else None for d in (sampler.draw(rng) for _ in range(4000))]
    assert abs(kinds.count("error") / 4000 - 0.25) < 0.03


def _described_faults(path: Path, faulty_body: str) -> list[dict]:
    """Write a search profile whose model is `faulty` with `faulty_body` (its indented lines) to
    `path`; the faults `emulators describe --json` lists for it."""
    path.write_text("tool: search\nmodel:\n  kind: faulty\n" + faulty_body)
    described = runner.invoke(app, ["emulators", "describe", str(path), "--json"])
    assert described.exit_code == 0, described.output
    return json.loads(described.stdout)["faults"]
