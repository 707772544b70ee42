"""`toolenv rollout calibrate`'s argument checks, without an engine: each bad option is one line,
exit 2, before anything is measured (the engine is a closed port on loopback, exit 3 if reached)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from testkit import free_port
from typer.testing import CliRunner

from rollout_client.calibrate import CalibrationPlan, calibrate_engine
from rollout_client.engines.base import Generation
from rollout_client.engines.costmodel import CostModel
from rollout_client.engines.eventsim import EventSimEngine
from toolenv.cli import build_app

app = build_app()


def calibrate(*args: str) -> Result:
    engine = ["--engine", "openai", "--openai-url", f"http://127.0.0.1:{free_port()}"]
    return CliRunner().invoke(app, ["rollout", "calibrate", *engine, *args])


def one_line_error(result: Result) -> str:
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (
        result.output,
        result.exception,
    )
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("config", "said"),
    [
        (None, "[Errno 2] No such file or directory"),
        ("{}", "no vocab_size"),
        ('{"vocab_size": "x"}', "invalid literal for int()"),
    ],
)
def test_a_model_without_a_readable_vocabulary_is_one_line(
    tmp_path: Path, config: str | None, said: str
) -> None:
    """calibrate printed a FileNotFoundError / KeyError traceback (run said it in one line)."""
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    error = one_line_error(calibrate("--model", str(tmp_path)))
    assert error.startswith(f"error: cannot read the vocabulary size from {tmp_path}/config.json: ")
    assert said in error


def test_an_out_it_cannot_write_is_refused_before_the_calibration(tmp_path: Path) -> None:
    """It was written after minutes of measuring: an IsADirectoryError traceback, the work lost."""
    said = one_line_error(calibrate("--out", str(tmp_path)))
    assert said == f"error: --out {tmp_path}: is a directory; name a file"
    nowhere = tmp_path / "no" / "p.json"
    said = one_line_error(calibrate("--out", str(nowhere)))
    assert said == f"error: --out {nowhere}: there is no directory {nowhere.parent}"


def test_an_out_onto_the_check_trace_is_refused_before_the_engine(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """`--check T --out T` measured for minutes, then wrote the profile over the trace (exit 3
    here: the closed port was reached first)."""
    trace = tmp_path / "check.jsonl"
    source = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    trace.write_text("".join(source.open().readlines()[:200]))
    said = one_line_error(calibrate("--check", str(trace), "--out", str(trace)))
    assert said == f"error: --out {trace}: is the trace {trace} --check reads; name another file"


@pytest.mark.parametrize(
    ("option", "value", "said"),
    [
        ("--check-length-scale", "nan", "--check-length-scale must be a finite number above 0"),
        ("--check-length-scale", "-1", "--check-length-scale must be a finite number above 0"),
        ("--check-tool-scale", "-1", "--check-tool-scale must be a finite number above 0"),
        ("--check-tool-scale", "inf", "--check-tool-scale must be a finite number above 0"),
        ("--check-trajectories", "0", "Invalid value for '--check-trajectories'"),
        ("--check-max-output", "0", "Invalid value for '--check-max-output'"),
        ("--check-length-scale", "1e9", "a trajectory holds at most 1,048,576"),  # MemoryError
    ],
)
def test_a_check_option_out_of_range_is_refused_before_the_engine(
    polytrace_dir: Path, option: str, value: str, said: str
) -> None:
    """Each went on to the engine (exit 3 here; a negative scale or no trajectories with one)."""
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    done = calibrate("--check", str(trace), option, value)
    assert done.exit_code == 2, (done.output, done.exception)
    assert said in done.stderr and "Traceback" not in done.output


@pytest.mark.parametrize("option", ["--batches", "--prompt-lens"])
def test_a_list_option_that_is_not_numbers_names_the_option(option: str) -> None:
    said = one_line_error(calibrate(option, "4,abc"))  # was "invalid literal for int() ..."
    assert said == f"error: {option} takes comma-separated whole numbers, e.g. 1,4,16; got '4,abc'"


def test_the_engine_its_url_and_the_model_come_from_the_rollout_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The options' own defaults (`--engine vllm`, no model, no URL) were passed over the
    `TOOLENV_ROLLOUT_*` variables and the config file: "--engine vllm needs --model DIR" with
    TOOLENV_ROLLOUT_ENGINE=openai and its URL set, which `rollout run` takes."""
    url = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("TOOLENV_ROLLOUT_ENGINE", "openai")
    monkeypatch.setenv("TOOLENV_ROLLOUT_OPENAI_URLS", f'["{url}"]')
    out = ["--out", str(tmp_path / "p.json")]
    result = CliRunner().invoke(app, ["rollout", "calibrate", *out])
    assert result.exit_code == 3, result.output  # the engine's URL was tried: a closed port
    assert result.stderr.startswith(f"error: OpenAI-compatible server {url} does not answer")
    monkeypatch.delenv("TOOLENV_ROLLOUT_ENGINE")
    monkeypatch.setenv("TOOLENV_ROLLOUT_MODEL", str(tmp_path))  # vllm, the default engine
    said = one_line_error(CliRunner().invoke(app, ["rollout", "calibrate", *out]))
    assert said.startswith(f"error: cannot read the vocabulary size from {tmp_path}/config.json")


def test_vllm_not_installed_is_one_line_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It started measuring and died in a ModuleNotFoundError traceback (exit 1)."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed: find_spec is None
    (tmp_path / "config.json").write_text('{"vocab_size": 1000}')
    done = CliRunner().invoke(app, ["rollout", "calibrate", "--model", str(tmp_path)])
    said = one_line_error(done)
    assert said.startswith("error: --engine vllm needs vLLM") and "toolenv[vllm]" in said


@pytest.mark.parametrize(
    ("batches", "lens"), [("4", "64,512"), ("1,4,16", "512"), ("8,8", "64,64"), ("1", "64")]
)
def test_batches_that_cannot_tell_the_costs_apart_are_refused_before_the_engine(
    batches: str, lens: str
) -> None:
    """One batch size or one prompt length leaves the fit's columns collinear: least squares put
    the whole cost on one term, with a 0% fit error: fitted on an engine of known costs, a batch
    of 16 at 4,000-token prompts came out 2-100x off (exit 3 here: the closed port was reached
    first)."""
    said = one_line_error(calibrate("--batches", batches, "--prompt-lens", lens))
    assert said.startswith("error: --batches and --prompt-lens need two different values each")
    plan = CalibrationPlan(batches=[1, 4], prompt_lens=[64, 512])
    assert plan.underdetermined() is None


class _RefusesLongPrompts(EventSimEngine):
    """An engine whose context is 1,000 tokens: it refuses longer prompts, as vLLM does."""

    async def generate(self, request_id: str, prompt_ids: list[int], **kwargs: Any) -> Generation:
        if len(prompt_ids) > 1000:
            raise RuntimeError("http://127.0.0.1:1 answered 400: context too long\n{...}")
        return await super().generate(request_id, prompt_ids, **kwargs)


async def test_a_request_the_engine_refuses_is_one_line_naming_the_options() -> None:
    """A prompt past the engine's context (`--prompt-lens 64,9000` on vLLM's 8,192) died in
    vLLM's VLLMValidationError traceback, exit 1, after the engine's start."""
    cost = CostModel(prefill_per_token_s=4e-5, decode_base_s=0.004, decode_per_seq_s=0.001)
    plan = CalibrationPlan(batches=[1, 4], prompt_lens=[64, 2048], decode_tokens=8)
    with pytest.raises(ValueError) as refused:
        await calibrate_engine(_RefusesLongPrompts(cost), plan, name="t", vocab_size=1024)
    assert str(refused.value) == (
        "the engine refused a calibration request of 2048 prompt tokens and 8 to generate "
        "(--prompt-lens, --decode-tokens): http://127.0.0.1:1 answered 400: context too long"
    )
