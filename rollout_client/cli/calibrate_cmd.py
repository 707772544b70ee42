"""`toolenv rollout calibrate`: the engine cost model from a real engine."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from toolenv_core.console import counted
from toolenv_core.outputs import input_overwritten, output_file_problem
from toolenv_core.polytrace.kinds import files_of_kind
from toolenv_core.sigterm import ends_by_sigterm, sigterm_cancels

from ..calibrate import CalibrationPlan, calibrate_engine
from ..enginecheck import Runs, compare, measure_and_run, simulated_runs
from ..engines.costmodel import CostModel
from ..engines.openai_engine import EngineUnreachable
from ..session import build_engine, context_too_long, model_vocab_size
from ..settings import CHECK_ROUNDS, RolloutSettings
from ..workloads.replay import LengthScale, replay_plans
from .common import fail, one_line


def calibrate(
    engine: Annotated[
        str | None,
        typer.Option(
            "--engine",
            help="vllm | openai (default: TOOLENV_ROLLOUT_ENGINE or rollout.engine, else vllm)",
        ),
    ] = None,
    model: Annotated[Path | None, typer.Option("--model", help="Model directory (vllm).")] = None,
    openai_url: Annotated[
        list[str] | None, typer.Option("--openai-url", help="OpenAI-compatible server.")
    ] = None,
    batches: Annotated[
        str, typer.Option("--batches", help="Batch sizes to measure, comma-separated.")
    ] = "1,4,16",
    prompt_lens: Annotated[
        str, typer.Option("--prompt-lens", help="Prompt lengths, comma-separated.")
    ] = "64,512",
    decode_tokens: Annotated[
        int, typer.Option("--decode-tokens", help="Tokens generated per request.")
    ] = 32,
    name: Annotated[str, typer.Option("--name", help="Profile name.")] = "calibrated",
    out: Annotated[Path, typer.Option("--out", help="Where to write the profile JSON.")] = Path(
        "cost-profile.json"
    ),
    check: Annotated[
        Path | None,
        typer.Option(
            "--check",
            help="Fit on a workload instead: run two sets of this search_r1 trace's trajectories "
            "on the engine under sync, async, async+overlap; fit the model on the first set's "
            "iterations, replay the second in virtual time and report the agreement.",
        ),
    ] = None,
    check_trajectories: Annotated[
        int, typer.Option("--check-trajectories", min=1, help="Trajectories per check step.")
    ] = 64,
    check_length_scale: Annotated[
        float, typer.Option("--check-length-scale", help="Scale of the check's trace lengths.")
    ] = 0.1,
    check_max_output: Annotated[
        int, typer.Option("--check-max-output", min=1, help="Cap on each check turn's output.")
    ] = 32,
    check_tool_scale: Annotated[
        float, typer.Option("--check-tool-scale", help="Scale of the check's tool latencies.")
    ] = 0.1,
    check_rounds: Annotated[
        int,
        typer.Option("--check-rounds", min=1, help="Real runs per policy (medians compared)."),
    ] = CHECK_ROUNDS,
    as_json: Annotated[bool, typer.Option("--json", help="Print the profile as JSON.")] = False,
) -> None:
    """Fit the simulator's cost model from a real engine and save it (use with --cost-profile FILE)."""
    # Checked before the engine starts: a bad scale was found after it (NaN as "cannot convert
    # float NaN to integer", a negative one not at all); --out after the whole calibration.
    _check_scale(check_length_scale, "--check-length-scale")
    _check_scale(check_tool_scale, "--check-tool-scale")
    if (problem := output_file_problem(out)) is not None:
        fail(f"--out {out}: {problem}")
    try:
        plan = CalibrationPlan(
            batches=_int_list(batches, "--batches"),
            prompt_lens=_int_list(prompt_lens, "--prompt-lens"),
            decode_tokens=decode_tokens,
        )
        # --check refits every cost on the workload's iterations: its batches only warm up
        if check is None and (problem := plan.underdetermined()) is not None:
            fail(problem)
        # only what was given: the options' defaults hid TOOLENV_ROLLOUT_* and the config file
        given = {
            "engine": engine,
            "model": str(model) if model else None,
            "openai_urls": openai_url,
        }
        settings = RolloutSettings.load(None, **{k: v for k, v in given.items() if v})
        if "engine" not in settings.model_fields_set:  # calibrate measures a real engine
            settings = settings.model_copy(update={"engine": "vllm"})
        if settings.engine == "sim":
            fail("calibrate measures a real engine: --engine vllm or --engine openai")
        eng = build_engine(settings)
        vocab = model_vocab_size(settings.model) if settings.model else settings.vocab_size
        rows = None
        if check is None:
            with ends_by_sigterm():  # SIGTERM unwinds as Ctrl-C does: the engine is closed
                calibrated = calibrate_engine(eng, plan, name=name, vocab_size=vocab)
                profile = asyncio.run(sigterm_cancels(calibrated))
        else:
            n_check = math.ceil(check_trajectories * 1.25)  # overlap launches N * 1.25
            scale = LengthScale(check_length_scale, None, check_max_output, 4 * check_max_output)
            files = files_of_kind([check], "multiturn")
            if (same := input_overwritten(out, files)) is not None:  # after minutes of measuring
                fail(f"--out {out}: is the trace {same} --check reads; name another file")
            limit = 2 * n_check  # the check set, then as many again to calibrate on
            plans = list(replay_plans(files, scale=scale, exact=True, limit=limit))
            if len(plans) < limit:
                held = counted(len(plans), "trajectory")
                fail(f"--check {check} holds {held}; the check needs {limit}")
            too_long = context_too_long(plans, "lower --check-length-scale")
            if too_long is not None:
                fail(too_long)
            status = Console(stderr=True).status(
                f"calibrating, then a warm-up round and {counted(check_rounds, 'round')} of both "
                "workloads"
            )

            async def measured() -> tuple[CostModel, Runs, Runs]:
                async with eng:
                    return await measure_and_run(
                        eng,
                        plan,
                        name=name,
                        vocab_size=vocab,
                        plans=plans[:n_check],
                        calibration=plans[n_check:],
                        batch=check_trajectories,
                        tool_scale=check_tool_scale,
                        rounds=check_rounds,
                    )

            with ends_by_sigterm(), status:
                profile, _, real = asyncio.run(sigterm_cancels(measured()))
            rows = compare(
                real,
                simulated_runs(profile, plans[:n_check], check_trajectories, check_tool_scale),
            )
    except EngineUnreachable as exc:
        fail(str(exc), code=3)
    except ValueError as exc:
        fail(one_line(exc))
    try:
        profile.save(out)
    except OSError as exc:
        fail(f"--out {out}: cannot write the profile: {exc.strerror or exc}")
    if as_json:
        typer.echo(json.dumps({"profile": profile.model_dump(), "check": rows}, indent=2))
        return
    err = profile.fit_error or {}
    typer.echo(
        f"prefill {profile.prefill_per_token_s * 1e6:.1f} us/token + "
        f"{profile.prefill_per_seq_s * 1e3:.3f} ms/sequence; decode iteration "
        f"{profile.decode_base_s * 1e3:.2f} ms + {profile.decode_per_seq_s * 1e3:.3f} ms/seq + "
        f"{profile.decode_per_ctx_token_s * 1e6:.3f} us/context token; waking from idle "
        f"{profile.idle_wake_s * 1e3:.1f} ms; per request arriving at a busy engine "
        f"{profile.busy_arrival_s * 1e3:.2f} ms (microbenchmark fit: mean |error| "
        f"{err.get('iteration_mean_abs_rel_error', 0):.1%} per iteration); wrote {out}"
    )
    if "workload_run_slowdown_max" in err:
        typer.echo(
            f"fitted on {counted(round(err['workload_iterations']), 'iteration')} of the "
            "calibration runs; "
            f"each run's iteration times over the median run's (the machine's load): "
            f"{err['workload_run_slowdown_min']:.2f}-{err['workload_run_slowdown_max']:.2f}x"
        )
    for row in rows or []:
        spread = ", ".join(f"{a:.1%}" for a in row["makespan_accuracy_per_run"])
        turn_spread = ", ".join(f"{a:.1%}" for a in row["turn_latency_accuracy_per_run"])
        typer.echo(
            f"{row['policy']:>14}: makespan real {row['makespan_real_s']:.3f} s (median), sim "
            f"{row['makespan_sim_s']:.3f} s (accuracy {row['makespan_accuracy']:.1%}; per run "
            f"{spread}); mean turn latency real {row['turn_latency_real_s']:.3f} s, sim "
            f"{row['turn_latency_sim_s']:.3f} s (accuracy {row['turn_latency_accuracy']:.1%}; "
            f"per run {turn_spread})"
        )


def _check_scale(value: float, option: str) -> None:
    """A scale multiplies lengths or latencies: a finite number above 0 (typer's `min` lets NaN by)."""
    if not (math.isfinite(value) and value > 0):
        fail(f"{option} must be a finite number above 0, got {value}")


def _int_list(value: str, option: str) -> list[int]:
    """`"1,4,16"` -> [1, 4, 16]; anything else names the option (int() said only the word)."""
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        fail(f"{option} takes comma-separated whole numbers, e.g. 1,4,16; got {value!r}")
