"""`toolenv rollout run`: one rollout, live or in virtual time, with its report."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from toolenv_core.cli_options import ConfigFileOption
from toolenv_core.config import config_error
from toolenv_core.console import counted
from toolenv_core.polytrace import TraceFormatError
from toolenv_core.polytrace.cache import resolve_traces, trace_cache_dir
from toolenv_core.sigterm import ends_by_sigterm, sigterm_cancels

from ..clock import VirtualTimeDeadlock, run_virtual
from ..engines.openai_engine import EngineUnreachable
from ..gateway_client import GatewayUnreachable
from ..policies import build_policy
from ..report import PLOTS, drop_plots_not_written, modelled, plot, print_table
from ..session import model_vocab_size
from ..settings import RolloutSettings
from .common import (
    POLICY_HELP,
    fail,
    idle_option_notes,
    one_line,
    out_dir_for_run,
    setting_default,
    tool_pairs,
)
from .run_driver import run_with_progress

TOOL_PROFILE_HINT = (
    "--tool-profile TOOL=FILE (a profile from `toolenv emulators fit`, or a shipped one by "
    "name: search=search_default)"
)


def run(
    trace: Annotated[
        list[Path] | None,
        typer.Option(
            "--trace",
            help="PolyTrace multi-turn JSONL, or a directory of them; a name not on disk is looked "
            "up in the trace cache (`toolenv traces fetch`). Repeatable.",
        ),
    ] = None,
    synthetic: Annotated[
        Path | None,
        typer.Option(
            "--synthetic", help="intern_s1 fitted-parameters JSON: draw trajectories from it."
        ),
    ] = None,
    live: Annotated[
        Path | None,
        typer.Option(
            "--live",
            help="JSONL of chat prompts: the model's text decides the tool calls (needs --model).",
        ),
    ] = None,
    max_turns: Annotated[
        int | None,
        typer.Option(
            "--max-turns",
            show_default=setting_default("live_max_turns"),
            help="live: turns per trajectory at most.",
        ),
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-tokens",
            show_default=setting_default("live_max_tokens"),
            help="live: tokens per turn at most.",
        ),
    ] = None,
    gateway: Annotated[
        str | None,
        typer.Option(
            "--gateway", show_default=setting_default("gateway_url"), help="Gateway base URL."
        ),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(
            "--engine", show_default=setting_default("engine"), help="vllm | openai | sim"
        ),
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            show_default=setting_default("model"),
            help="Model directory (vllm; vocab size).",
        ),
    ] = None,
    openai_url: Annotated[
        list[str] | None,
        typer.Option(
            "--openai-url",
            show_default=setting_default("openai_urls"),
            help="OpenAI-compatible server (repeatable).",
        ),
    ] = None,
    policy: Annotated[
        str | None,
        typer.Option("--policy", show_default=setting_default("policy"), help=POLICY_HELP),
    ] = None,
    steps: Annotated[
        int | None,
        typer.Option("--steps", show_default=setting_default("steps"), help="Rollout steps."),
    ] = None,
    batch: Annotated[
        int | None,
        typer.Option(
            "--batch",
            show_default=setting_default("batch"),
            help="Trajectories completing each step (N).",
        ),
    ] = None,
    tool_timeout: Annotated[
        float | None,
        typer.Option(
            "--tool-timeout",
            show_default=setting_default("tool_timeout_s"),
            help="Seconds per tool call (timeout policy).",
        ),
    ] = None,
    overlap_ratio: Annotated[
        float | None,
        typer.Option(
            "--overlap-ratio",
            show_default=setting_default("overlap_ratio"),
            help="overlap launches N*(1+ratio).",
        ),
    ] = None,
    unfinished: Annotated[
        str | None,
        typer.Option(
            "--unfinished",
            show_default=setting_default("overlap_unfinished"),
            help="overlap: carry | abort.",
        ),
    ] = None,
    exact: Annotated[
        bool | None,
        typer.Option(
            "--exact/--no-exact",
            show_default=setting_default("exact"),
            help="Replay each call's recorded latency.",
        ),
    ] = None,
    length_scale: Annotated[
        float | None,
        typer.Option(
            "--length-scale",
            show_default=setting_default("length_scale"),
            help="Multiply every trace length.",
        ),
    ] = None,
    max_prompt: Annotated[
        int | None,
        typer.Option(
            "--max-prompt",
            show_default=setting_default("max_prompt"),
            help="Cap on the prompt length.",
        ),
    ] = None,
    max_output: Annotated[
        int | None,
        typer.Option(
            "--max-output",
            show_default=setting_default("max_output"),
            help="Cap on each turn's output.",
        ),
    ] = None,
    max_append: Annotated[
        int | None,
        typer.Option(
            "--max-append",
            show_default=setting_default("max_append"),
            help="Cap on each tool response.",
        ),
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit",
            show_default=setting_default("limit"),
            help="Use at most this many trajectories.",
        ),
    ] = None,
    sample: Annotated[
        float | None,
        typer.Option(
            "--sample",
            show_default=setting_default("sample"),
            help="Keep each trajectory with this probability.",
        ),
    ] = None,
    seed: Annotated[
        int | None, typer.Option("--seed", show_default=setting_default("seed"))
    ] = None,
    cost_profile: Annotated[
        str | None,
        typer.Option(
            "--cost-profile",
            show_default=setting_default("cost_profile"),
            help="sim: built-in name or calibrate JSON.",
        ),
    ] = None,
    time_scale: Annotated[
        float | None,
        typer.Option(
            "--time-scale",
            show_default=setting_default("time_scale"),
            help="sim: run this many times faster.",
        ),
    ] = None,
    clock: Annotated[
        str | None,
        typer.Option(
            "--clock",
            show_default=setting_default("clock"),
            help="sim: wall (real time, tools through the gateway) or virtual (a simulated clock: "
            "no sleeping, no HTTP, deterministic for a seed).",
        ),
    ] = None,
    tool_profile: Annotated[
        list[str] | None,
        typer.Option(
            "--tool-profile",
            help="virtual: TOOL=FILE latency profile, written by `toolenv emulators fit` or one the "
            "emulators ship, by name (search=search_default); "
            "without one a tool replays recorded latencies (--exact).",
        ),
    ] = None,
    tool_scale: Annotated[
        float | None,
        typer.Option(
            "--tool-scale",
            show_default=setting_default("tool_scale"),
            help="virtual: multiply every tool latency.",
        ),
    ] = None,
    hedge_quantile: Annotated[
        float | None,
        typer.Option(
            "--hedge-quantile",
            show_default=setting_default("hedge_quantile"),
            help="hedge policy: second attempt after this quantile.",
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", show_default=setting_default("out_dir"), help="Output directory."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the JSON report instead of the table.")
    ] = False,
    no_plots: Annotated[bool, typer.Option("--no-plots", help="Skip the PNG plots.")] = False,
    config: ConfigFileOption = None,
) -> None:
    """Run rollout steps and write report.json, trajectories.jsonl (a replayable trace) and PNG plots."""
    overrides = {
        "gateway_url": gateway,
        "engine": engine,
        "model": str(model) if model else None,
        "openai_urls": openai_url or None,
        "policy": policy,
        "steps": steps,
        "batch": batch,
        "tool_timeout_s": tool_timeout,
        "overlap_ratio": overlap_ratio,
        "overlap_unfinished": unfinished,
        "exact": exact,
        "length_scale": length_scale,
        "max_prompt": max_prompt,
        "max_output": max_output,
        "max_append": max_append,
        "limit": limit,
        "sample": sample,
        "seed": seed,
        "cost_profile": cost_profile,
        "time_scale": time_scale,
        "clock": clock,
        "tool_profiles": tool_pairs(tool_profile, "--tool-profile") if tool_profile else None,
        "tool_scale": tool_scale,
        "hedge_quantile": hedge_quantile,
        "out_dir": str(out) if out else None,
        "live_max_turns": max_turns,
        "live_max_tokens": max_tokens,
    }
    try:
        settings = RolloutSettings.load(
            config, **{k: v for k, v in overrides.items() if v is not None}
        )
        if settings.clock == "virtual" and settings.engine != "sim":
            raise ValueError("--clock virtual needs --engine sim (a real engine runs in real time)")
        if settings.clock == "virtual" and not settings.exact and not settings.tool_profiles:
            raise ValueError(
                "--clock virtual answers tools in process: replay recorded latencies with --exact "
                f"or draw them from {TOOL_PROFILE_HINT}"
            )
        if settings.clock == "virtual" and synthetic is not None and not settings.tool_profiles:
            raise ValueError(  # --exact let it start, and every trajectory with a call failed
                "--synthetic trajectories record no tool latencies for --exact to replay: on "
                f"--clock virtual draw them from {TOOL_PROFILE_HINT}"
            )
        build_policy(
            settings.policy, tool_timeout_s=settings.tool_timeout_s, over=settings.overlap_ratio
        )
    except (ValidationError, ValueError) as exc:
        fail(one_line(exc))
    given = [o for o, v in (("--trace", trace), ("--synthetic", synthetic), ("--live", live)) if v]
    if not given:
        fail(
            "give at least one --trace PATH (PolyTrace multi-turn JSONL), --synthetic PARAMS.json "
            "or --live PROMPTS.jsonl"
        )
    if len(given) > 1:  # each chooses the workload alone: the others were silently ignored
        fail(f"{' and '.join(given)} each choose the workload: give one of them")
    if (
        settings.engine == "sim"
        and settings.clock == "wall"
        and settings.time_scale != 1
        and not (trace and settings.exact and not live)
    ):
        fail(
            "--time-scale compresses the simulated engine, the tool timeouts and the recorded delays "
            "that --trace ... --exact replays; without them the emulator draws tool latencies in "
            "real time, so tools would run time-scale times too slow: add --exact or drop --time-scale"
        )
    if settings.model:
        try:
            settings = settings.model_copy(update={"vocab_size": model_vocab_size(settings.model)})
        except ValueError as exc:
            fail(str(exc))
    try:  # the trace cache of the --config file given (`traces.cache_dir`), not TOOLENV_CONFIG's
        cache = trace_cache_dir(config)
        trace = resolve_traces(trace, cache) if trace else trace
        if synthetic is not None:
            [synthetic] = resolve_traces([synthetic], cache)
    except TraceFormatError as exc:
        fail(str(exc))
    except ValueError as exc:  # the file's traces section, or a TOOLENV_TRACES_* variable
        fail(config_error(exc))
    workload = given[0]
    given = {k for k, v in overrides.items() if v is not None}
    for note in idle_option_notes(settings, given, workload):
        typer.echo(note, err=True)
    out_dir = Path(settings.out_dir)
    with ends_by_sigterm(), out_dir_for_run(out_dir):
        try:  # SIGTERM unwinds as Ctrl-C does: a real engine's processes are closed
            main = sigterm_cancels(
                run_with_progress(settings, trace or [], synthetic, out_dir, live)
            )
            report = run_virtual(main) if settings.clock == "virtual" else asyncio.run(main)
        except TraceFormatError as exc:
            fail(str(exc))
        except (GatewayUnreachable, EngineUnreachable) as exc:
            fail(str(exc), code=3)
        except VirtualTimeDeadlock as exc:
            fail(str(exc))
        except ValueError as exc:
            fail(one_line(exc))
        except OSError as exc:  # writing the report (a full disk): a traceback, exit 1
            if exc.filename is None:
                raise
            fail(f"--out {out_dir}: cannot write {exc.filename}: {exc.strerror or exc}")
    timelines = report.pop("_timelines", [])
    records = report.pop("_records", None) or []
    for note in [*report["notes"], *tool_error_note(report["summary"], records)]:
        typer.echo(note, err=True)
    written = plot(report, timelines, out_dir) if not no_plots and report["steps"] else []
    drop_plots_not_written(out_dir, PLOTS, written)
    summary = report["summary"]
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        print_table(report)
        s = report["summary"]
        makespans = sum(step["modeled_makespan_s"] for step in report["steps"])
        typer.echo(
            f"{counted(s.get('completed', 0), 'trajectory')} in {makespans:.2f} "
            f"{modelled(report)}s "
            f"(wall {report['wall']['elapsed_s']:.2f} s); "
            f"engine busy {s.get('engine_busy_fraction', 0):.0%}; wrote {out_dir}/report.json, "
            f"{out_dir}/trajectories.jsonl" + ("" if no_plots else " and PNG plots")
        )
    if summary.get("failed"):
        first = next(f for step in report["steps"] for f in step["failures"])
        failed = counted(summary["failed"], "trajectory")
        typer.echo(f"error: {failed} failed, e.g. {first}", err=True)
        raise typer.Exit(1)


def tool_error_note(summary: dict, records: list) -> list[str]:
    """A note when tool calls failed, with the first reason: the report counted them alone
    (`tool errors 6`), and a run whose own arguments a tool refuses (`--max-append 10` under
    what the search emulator returns for its documents) looked like a failing tool."""
    failed = summary.get("tool_errors", 0)
    if not failed:
        return []
    errors = (c.error for r in records for c in r.tool_calls if c.status == "error" and c.error)
    first = next(errors, None)
    return [
        f"note: {counted(failed, 'tool call')} failed (each trajectory went on with an error "
        "observation)" + (f", e.g. {first}" if first else "")
    ]
