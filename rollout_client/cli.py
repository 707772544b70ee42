"""rollout_client subcommands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from .settings import RolloutSettings

app = typer.Typer(
    help="Multi-turn rollouts through the gateway, with straggler policies.", no_args_is_help=True
)


def _default(field: str) -> str:
    """A setting's default as `--help` shows it (options default to None so that config files
    and TOOLENV_ROLLOUT_* variables can fill them in)."""
    value = RolloutSettings.model_fields[field].get_default(call_default_factory=True)
    return (
        "none"
        if value is None or value == []
        else str(value).lower()
        if isinstance(value, bool)
        else str(value)
    )


_POLICY_HELP = (
    "sync|async, combinable with +timeout, +hedge (virtual clock) and +overlap "
    "(e.g. async+timeout+overlap)."
)


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@app.command("settings")
def show_settings() -> None:
    """Print this service's effective settings as JSON."""
    from .settings import RolloutSettings as S

    typer.echo(S.load().model_dump_json(indent=2))


@app.command("run")
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
            show_default=_default("live_max_turns"),
            help="live: turns per trajectory at most.",
        ),
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-tokens",
            show_default=_default("live_max_tokens"),
            help="live: tokens per turn at most.",
        ),
    ] = None,
    gateway: Annotated[
        str | None,
        typer.Option("--gateway", show_default=_default("gateway_url"), help="Gateway base URL."),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option("--engine", show_default=_default("engine"), help="vllm | openai | sim"),
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model", show_default=_default("model"), help="Model directory (vllm; vocab size)."
        ),
    ] = None,
    openai_url: Annotated[
        list[str] | None,
        typer.Option(
            "--openai-url",
            show_default=_default("openai_urls"),
            help="OpenAI-compatible server (repeatable).",
        ),
    ] = None,
    policy: Annotated[
        str | None, typer.Option("--policy", show_default=_default("policy"), help=_POLICY_HELP)
    ] = None,
    steps: Annotated[
        int | None, typer.Option("--steps", show_default=_default("steps"), help="Rollout steps.")
    ] = None,
    batch: Annotated[
        int | None,
        typer.Option(
            "--batch", show_default=_default("batch"), help="Trajectories completing each step (N)."
        ),
    ] = None,
    tool_timeout: Annotated[
        float | None,
        typer.Option(
            "--tool-timeout",
            show_default=_default("tool_timeout_s"),
            help="Seconds per tool call (timeout policy).",
        ),
    ] = None,
    overlap_ratio: Annotated[
        float | None,
        typer.Option(
            "--overlap-ratio",
            show_default=_default("overlap_ratio"),
            help="overlap launches N*(1+ratio).",
        ),
    ] = None,
    unfinished: Annotated[
        str | None,
        typer.Option(
            "--unfinished",
            show_default=_default("overlap_unfinished"),
            help="overlap: carry | abort.",
        ),
    ] = None,
    exact: Annotated[
        bool | None,
        typer.Option(
            "--exact/--no-exact",
            show_default=_default("exact"),
            help="Replay each call's recorded latency.",
        ),
    ] = None,
    length_scale: Annotated[
        float | None,
        typer.Option(
            "--length-scale",
            show_default=_default("length_scale"),
            help="Multiply every trace length.",
        ),
    ] = None,
    max_prompt: Annotated[
        int | None,
        typer.Option(
            "--max-prompt", show_default=_default("max_prompt"), help="Cap on the prompt length."
        ),
    ] = None,
    max_output: Annotated[
        int | None,
        typer.Option(
            "--max-output", show_default=_default("max_output"), help="Cap on each turn's output."
        ),
    ] = None,
    max_append: Annotated[
        int | None,
        typer.Option(
            "--max-append", show_default=_default("max_append"), help="Cap on each tool response."
        ),
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option(
            "--limit", show_default=_default("limit"), help="Use at most this many trajectories."
        ),
    ] = None,
    sample: Annotated[
        float | None,
        typer.Option(
            "--sample",
            show_default=_default("sample"),
            help="Keep each trajectory with this probability.",
        ),
    ] = None,
    seed: Annotated[int | None, typer.Option("--seed", show_default=_default("seed"))] = None,
    cost_profile: Annotated[
        str | None,
        typer.Option(
            "--cost-profile",
            show_default=_default("cost_profile"),
            help="sim: built-in name or calibrate JSON.",
        ),
    ] = None,
    time_scale: Annotated[
        float | None,
        typer.Option(
            "--time-scale",
            show_default=_default("time_scale"),
            help="sim: run this many times faster.",
        ),
    ] = None,
    clock: Annotated[
        str | None,
        typer.Option(
            "--clock",
            help="sim: wall (real time, tools through the gateway) or virtual (a simulated clock: "
            "no sleeping, no HTTP, deterministic for a seed).",
        ),
    ] = None,
    tool_profile: Annotated[
        list[str] | None,
        typer.Option(
            "--tool-profile",
            help="virtual: TOOL=FILE latency profile (e.g. search=emulators/profiles/"
            "search_default.yaml); without one a tool replays recorded latencies (--exact).",
        ),
    ] = None,
    tool_scale: Annotated[
        float | None,
        typer.Option(
            "--tool-scale",
            show_default=_default("tool_scale"),
            help="virtual: multiply every tool latency.",
        ),
    ] = None,
    hedge_quantile: Annotated[
        float | None,
        typer.Option(
            "--hedge-quantile",
            show_default=_default("hedge_quantile"),
            help="hedge policy: second attempt after this quantile.",
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", show_default=_default("out_dir"), help="Output directory."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the JSON report instead of the table.")
    ] = False,
    no_plots: Annotated[bool, typer.Option("--no-plots", help="Skip the PNG plots.")] = False,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="Config file (YAML/TOML/JSON).")
    ] = None,
) -> None:
    """Run rollout steps and write report.json, trajectories.jsonl (a replayable trace) and PNG plots."""
    import asyncio

    from pydantic import ValidationError

    from toolenv_core.polytrace import TraceFormatError

    from .clock import run_virtual
    from .engines.openai_engine import EngineUnreachable
    from .gateway_client import GatewayUnreachable
    from .policies import build_policy
    from .settings import RolloutSettings

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
        "tool_profiles": _pairs(tool_profile, "--tool-profile") if tool_profile else None,
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
                "or draw them from --tool-profile TOOL=FILE (e.g. search=emulators/profiles/"
                "search_default.yaml)"
            )
        build_policy(
            settings.policy, tool_timeout_s=settings.tool_timeout_s, over=settings.overlap_ratio
        )
    except (ValidationError, ValueError) as exc:
        _fail(_one_line(exc))
    if not trace and synthetic is None:
        _fail(
            "give at least one --trace PATH (PolyTrace multi-turn JSONL) or --synthetic PARAMS.json"
        )
    if (
        settings.engine == "sim"
        and settings.clock == "wall"
        and settings.time_scale != 1
        and not (trace and settings.exact and not live)
    ):
        _fail(
            "--time-scale compresses the simulated engine, the tool timeouts and the recorded delays "
            "that --trace ... --exact replays; without them the emulator draws tool latencies in "
            "real time, so tools would run time-scale times too slow: add --exact or drop --time-scale"
        )
    if settings.model:
        from .session import model_vocab_size

        try:
            settings = settings.model_copy(update={"vocab_size": model_vocab_size(settings.model)})
        except (OSError, ValueError, KeyError) as exc:
            _fail(f"cannot read the vocabulary size from {settings.model}/config.json: {exc}")
    out_dir = Path(settings.out_dir)
    try:
        main = _run_with_progress(settings, trace or [], synthetic, out_dir, live)
        report = run_virtual(main) if settings.clock == "virtual" else asyncio.run(main)
    except TraceFormatError as exc:
        _fail(str(exc))
    except (GatewayUnreachable, EngineUnreachable) as exc:
        _fail(str(exc), code=3)
    except ValueError as exc:
        _fail(_one_line(exc))
    from .report import plot, print_table

    timelines = report.pop("_timelines", [])
    report.pop("_records", None)
    for note in report["notes"]:
        typer.echo(note, err=True)
    if not no_plots and report["steps"]:
        plot(report, timelines, out_dir)
    summary = report["summary"]
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        print_table(report)
        s = report["summary"]
        modelled = sum(step["modeled_makespan_s"] for step in report["steps"])
        typer.echo(
            f"{s.get('completed', 0)} trajectories in {modelled:.2f} modelled s "
            f"(wall {report['wall']['elapsed_s']:.2f} s); "
            f"engine busy {s.get('engine_busy_fraction', 0):.0%}; wrote {out_dir}/report.json, "
            f"{out_dir}/trajectories.jsonl" + ("" if no_plots else " and PNG plots")
        )
        if report.get("sim_lag_s", 0) > 0.05 * max(s.get("total_makespan_s", 0), 1e-9):
            typer.echo(
                f"note: the simulator fell {report['sim_lag_s']:.1f} s behind its cost model "
                "(CPU starved); lower --time-scale for faithful timings",
                err=True,
            )
    if summary.get("failed"):
        first = next(f for step in report["steps"] for f in step["failures"])
        typer.echo(f"error: {summary['failed']} trajectories failed, e.g. {first}", err=True)
        raise typer.Exit(1)


async def _run_with_progress(
    settings, traces: list[Path], synthetic: Path | None, out_dir: Path, live: Path | None = None
) -> dict:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .session import build_live, build_plans, run_rollout

    driver = None
    if live is not None:
        plans, driver = build_live(settings, live)
    else:
        # Parse the whole trace selection first: a malformed line fails before any engine starts.
        plans = list(build_plans(settings, traces, synthetic))
    if not plans:
        raise ValueError("the trace selection is empty (check --trace, --limit and --sample)")
    from .policies import build_policy

    launch = build_policy(
        settings.policy, over=settings.overlap_ratio, hedge_quantile=settings.hedge_quantile
    ).launch_count(settings.batch)
    notes = []
    if len(plans) < launch * settings.steps:
        notes.append(
            f"note: {len(plans)} trajectories selected (trace size, --limit, --sample) for "
            f"{settings.steps} step(s) of --batch {settings.batch} (launching {launch} each): "
            + (
                f"the first step runs {len(plans)}"
                if len(plans) < launch
                else "later steps run short or not at all"
            )
        )
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(
            "turns {task.fields[turns]}  tool calls {task.fields[tools]}  timeouts {task.fields[timeouts]}"
        ),
        TimeElapsedColumn(),
        console=Console(stderr=True),  # stdout stays clean for --json
        transient=False,
    )
    state = {"task": None, "step": 0}

    def on_event(event) -> None:
        if state["task"] is None:
            state["task"] = progress.add_task(
                f"step {state['step']}",
                total=min(settings.batch, len(plans)),
                turns=0,
                tools=0,
                timeouts=0,
            )
        task = progress.tasks[[t.id for t in progress.tasks].index(state["task"])]
        fields = dict(task.fields)
        if event.kind == "turn_done":
            fields["turns"] += 1
        elif event.kind in ("tool_done", "tool_error"):
            fields["tools"] += 1
        elif event.kind == "tool_timeout":
            fields["tools"] += 1
            fields["timeouts"] += 1
        progress.update(
            state["task"], advance=1 if event.kind == "trajectory_done" else 0, **fields
        )

    def on_step(metrics: dict) -> None:
        state["step"] = metrics["step"] + 1
        state["task"] = None

    with progress:
        report = await run_rollout(
            settings, iter(plans), out_dir=out_dir, on_event=on_event, on_step=on_step
        )
    report["notes"] = notes
    return report


@app.command("study")
def study(
    trace: Annotated[
        list[Path],
        typer.Option(
            "--trace",
            help="search_r1 multi-turn JSONL or its directory, on disk or in the trace cache "
            "(repeatable; 3 steps for full runs).",
        ),
    ],
    reward_trace: Annotated[
        list[Path] | None,
        typer.Option(
            "--reward-trace",
            help="rllm_deepcoder reward_timings JSONL or its directory, on disk or in the trace "
            "cache (repeatable): the reward scenario.",
        ),
    ] = None,
    quick: Annotated[
        bool,
        typer.Option("--quick", help="256 trajectories per step and 7 policies (about a minute)."),
    ] = False,
    batch: Annotated[
        int | None, typer.Option("--batch", help="Trajectories per step (default 2048; quick 256).")
    ] = None,
    steps: Annotated[int, typer.Option("--steps", help="Steps per cell.")] = 2,
    cost_profile: Annotated[
        str, typer.Option("--cost-profile", help="Built-in engine profile or calibrate JSON.")
    ] = "searchr1-qwen7b",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    out: Annotated[Path, typer.Option("--out", help="Output directory.")] = Path("rollout-study"),
    as_json: Annotated[bool, typer.Option("--json", help="Print study.json to stdout.")] = False,
    no_plots: Annotated[bool, typer.Option("--no-plots", help="Skip the PNG plots.")] = False,
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray",
            flag_value="local",
            metavar="[ADDRESS]",
            help="Spread the cells over a Ray cluster as tasks (`auto`, HOST:PORT; no value: a "
            "local one). Same report as a local run for the same seed.",
        ),
    ] = None,
) -> None:
    """Every straggler policy against every tool scenario on full steps, in virtual time."""
    import sys

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from toolenv_core.polytrace import TraceFormatError

    from .study import JobRunner, StudyPlan, run_here, run_study
    from .study_report import markdown, write

    plan = (
        StudyPlan.quick(trace, reward_trace or [], seed=seed)
        if quick
        else StudyPlan(trace, reward_trace or [], seed=seed)
    )
    plan.steps, plan.cost_profile = steps, cost_profile
    if batch is not None:
        plan.batch = batch
    runner: JobRunner = run_here
    if ray_address is not None:
        try:  # Ray is an optional extra (`pip install toolenv[ray]`)
            from .study_ray import RayRunner
        except ImportError as exc:
            _fail(f"--ray needs Ray: pip install 'toolenv[ray]' ({exc})")
        runner = RayRunner(None if ray_address == "local" else ray_address)
    scenarios = [s for s in plan.scenarios if not s.reward or plan.reward_traces]
    total = len(scenarios) * len(plan.policies)
    progress = Progress(
        TextColumn("[bold]study"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[last]}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    )
    with progress:
        task = progress.add_task("cells", total=total, last="")

        def on_cell(row: dict) -> None:
            progress.update(
                task,
                advance=1,
                last=f"{row['scenario']} / {row['policy']}: {row['trajectories_per_s']:.2f} traj/s, "
                f"{row['calls_cut_share']:.1%} cut",
            )

        try:
            result = run_study(plan, on_cell, runner)
        except (TraceFormatError, ValueError) as exc:
            _fail(_one_line(exc))
    command = "toolenv rollout study " + " ".join(sys.argv[3:] if len(sys.argv) > 3 else [])
    write(result, out, command.strip(), plots=not no_plots)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        typer.echo(markdown(result, command.strip()))
        typer.echo(f"wrote {out}/study.md, {out}/study.json" + ("" if no_plots else " and PNGs"))


@app.command("validate")
def validate(
    trace: Annotated[
        list[Path],
        typer.Option("--trace", help="search_r1 step(s) to report on (multi-turn JSONL)."),
    ],
    cost_profile: Annotated[
        str, typer.Option("--cost-profile", help="Built-in engine profile or calibrate JSON.")
    ] = "searchr1-qwen7b",
    fit: Annotated[
        list[Path] | None,
        typer.Option(
            "--fit", help="Fit the profile on these steps first (never the reported ones)."
        ),
    ] = None,
    save_profile: Annotated[
        Path | None, typer.Option("--save-profile", help="Write the fitted profile here.")
    ] = None,
    plot_dir: Annotated[
        Path | None,
        typer.Option(
            "--plot-dir", help="Write validation-<step>.png (recorded vs simulated CDFs)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Replay recorded steps under verl's policy in virtual time and compare with their timings."""
    from rich.console import Console
    from rich.table import Table

    from toolenv_core.polytrace import TraceFormatError
    from toolenv_core.polytrace.kinds import files_of_kind

    from .engines.costmodel import load_cost_model
    from .validate import fit_cost_model, initial_guess, load_step, plot_step, validate_step

    console = Console(stderr=True)
    try:
        trace = files_of_kind(trace, "multiturn")  # directories, names in the trace cache
        fit = files_of_kind(fit, "multiturn") if fit else None
        cost = load_cost_model(cost_profile)
        fitted = None
        if fit:
            if set(map(str, fit)) & set(map(str, trace)):
                _fail("--fit and --trace must be different steps (never fit on what you report)")
            fit_steps = [load_step(p) for p in fit]
            with console.status("fitting the engine model") as status:
                start = initial_guess(fit_steps[0], cost)
                cost, loss = fit_cost_model(
                    fit_steps,
                    start,
                    on_trial=lambda c, v: status.update(f"fitting: loss {v:.3f}"),
                )
            cost = cost.model_copy(
                update={"source": f"toolenv rollout validate --fit {' --fit '.join(map(str, fit))}"}
            )
            fitted = {"profile": cost.model_dump(), "loss": round(loss, 4)}
            if save_profile is not None:
                cost.save(save_profile)
        results = []
        for path in trace:
            with console.status(f"replaying {path.name} in virtual time"):
                records = load_step(path)
                if plot_dir is not None:
                    png = plot_dir / f"validation-{path.stem}.png"
                    result = plot_step(records, cost, png, f"{path.name} replayed in virtual time")
                else:
                    result = validate_step(records, cost)
                results.append({"trace": str(path), **result})
    except (TraceFormatError, ValueError, OSError) as exc:
        _fail(_one_line(exc))
    report = {
        "cost_profile": cost.name,
        "policy": "async (verl SGLang multi-turn)",
        "fit": fitted,
        "steps": results,
    }
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    table = Table(
        title=f"validation against recorded timings (profile {cost.name})", title_justify="left"
    )
    for col in (
        "step",
        "makespan rec/sim (s)",
        "accuracy",
        "completion KS",
        "turn p50 rec/sim",
        "turn p90 rec/sim",
    ):
        table.add_column(col, justify="right")
    for r in results:
        rec, sim = r["turn_latency_recorded_s"], r["turn_latency_simulated_s"]
        table.add_row(
            Path(r["trace"]).name,
            f"{r['makespan_recorded_s']:.1f} / {r['makespan_simulated_s']:.1f}",
            f"{r['makespan_accuracy']:.1%}",
            f"{r['completion_ks']:.3f}",
            f"{rec['p50']:.1f} / {sim['p50']:.1f}",
            f"{rec['p90']:.1f} / {sim['p90']:.1f}",
        )
    Console().print(table)


@app.command("calibrate")
def calibrate(
    engine: Annotated[str, typer.Option("--engine", help="vllm | openai")] = "vllm",
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
            help="Then replay this search_r1 trace on the engine and on the fitted model (virtual "
            "time) under sync, async, async+overlap, and report their agreement.",
        ),
    ] = None,
    check_trajectories: Annotated[
        int, typer.Option("--check-trajectories", help="Trajectories per check step.")
    ] = 64,
    check_length_scale: Annotated[
        float, typer.Option("--check-length-scale", help="Scale of the check's trace lengths.")
    ] = 0.1,
    check_max_output: Annotated[
        int, typer.Option("--check-max-output", help="Cap on each check turn's output.")
    ] = 32,
    check_tool_scale: Annotated[
        float, typer.Option("--check-tool-scale", help="Scale of the check's tool latencies.")
    ] = 0.1,
    as_json: Annotated[bool, typer.Option("--json", help="Print the profile as JSON.")] = False,
) -> None:
    """Fit the simulator's cost model from a real engine and save it (use with --cost-profile FILE)."""
    import asyncio
    import math

    from .calibrate import CalibrationPlan, calibrate_engine
    from .engines.openai_engine import EngineUnreachable
    from .settings import RolloutSettings

    try:
        plan = CalibrationPlan(
            batches=[int(x) for x in batches.split(",") if x.strip()],
            prompt_lens=[int(x) for x in prompt_lens.split(",") if x.strip()],
            decode_tokens=decode_tokens,
        )
        settings = RolloutSettings.load(
            None, engine=engine, model=str(model) if model else None, openai_urls=openai_url or []
        )
        from .session import build_engine, model_vocab_size

        if settings.engine == "sim":
            _fail("calibrate measures a real engine: --engine vllm or --engine openai")
        eng = build_engine(settings)
        vocab = model_vocab_size(settings.model) if settings.model else settings.vocab_size
        rows = None
        if check is None:
            profile = asyncio.run(calibrate_engine(eng, plan, name=name, vocab_size=vocab))
        else:
            from toolenv_core.polytrace.kinds import files_of_kind

            from .enginecheck import calibrate_and_run, compare, fit_on_records, simulated_runs
            from .workloads.replay import LengthScale, replay_plans

            n_check = math.ceil(check_trajectories * 1.25)  # overlap launches N * 1.25
            scale = LengthScale(check_length_scale, None, check_max_output, 4 * check_max_output)
            files = files_of_kind([check], "multiturn")
            limit = n_check + check_trajectories  # then as many again to calibrate on
            plans = list(replay_plans(files, scale=scale, exact=True, limit=limit))
            if len(plans) < limit:
                _fail(f"--check {check} holds {len(plans)} trajectories; the check needs {limit}")
            from rich.console import Console

            status = Console(stderr=True).status(
                "calibrating, then replaying the check workload on the engine"
            )
            with status:
                first, recorded, real = asyncio.run(
                    calibrate_and_run(
                        eng,
                        plan,
                        name=name,
                        vocab_size=vocab,
                        plans=plans[:n_check],
                        calibration=plans[n_check:],
                        batch=check_trajectories,
                        tool_scale=check_tool_scale,
                    )
                )
            with Console(stderr=True).status("fitting the model, then the check in virtual time"):
                profile = fit_on_records(first, recorded)
                rows = compare(
                    real,
                    simulated_runs(profile, plans[:n_check], check_trajectories, check_tool_scale),
                )
    except EngineUnreachable as exc:
        _fail(str(exc), code=3)
    except ValueError as exc:
        _fail(_one_line(exc))
    profile.save(out)
    if as_json:
        typer.echo(json.dumps({"profile": profile.model_dump(), "check": rows}, indent=2))
        return
    err = profile.fit_error or {}
    typer.echo(
        f"prefill {profile.prefill_per_token_s * 1e6:.1f} us/token; decode iteration "
        f"{profile.decode_base_s * 1e3:.2f} ms + {profile.decode_per_seq_s * 1e3:.3f} ms/seq + "
        f"{profile.decode_per_ctx_token_s * 1e6:.3f} us/context token (fit: mean |error| "
        f"{err.get('iteration_mean_abs_rel_error', 0):.1%} per iteration, R2 "
        f"{err.get('iteration_r2', 0):.3f}); wrote {out}"
    )
    for row in rows or []:
        typer.echo(
            f"{row['policy']:>14}: makespan real {row['makespan_real_s']:.3f} s, sim "
            f"{row['makespan_sim_s']:.3f} s (accuracy {row['makespan_accuracy']:.1%}); mean turn "
            f"latency real {row['turn_latency_real_s']:.3f} s, sim {row['turn_latency_sim_s']:.3f} s "
            f"(accuracy {row['turn_latency_accuracy']:.1%})"
        )


def _pairs(values: list[str], option: str) -> dict[str, str]:
    """`["search=a.yaml"]` -> `{"search": "a.yaml"}`, with a clear error for a malformed pair."""
    pairs: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise typer.BadParameter(f"{option} takes TOOL=FILE, got {value!r}")
        pairs[name] = path
    return pairs


def _one_line(exc: Exception) -> str:
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        return f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
