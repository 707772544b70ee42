"""What `toolenv rollout run` does once its options are checked: the plans, the notes on them,
the rollout under a progress bar, and the note on a simulator that fell behind."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from toolenv_core.console import counted
from toolenv_core.polytrace.kinds import files_of_kind, repeat_notes

from ..policies import build_policy
from ..report import write_json
from ..session import build_live, build_plans, context_too_long, run_rollout, tool_profile_problems
from ..settings import RolloutSettings

LENGTH_HINT = (
    "lower --length-scale or cap the lengths with --max-prompt, --max-output, --max-append"
)


async def run_with_progress(
    settings: RolloutSettings,
    traces: list[Path],
    synthetic: Path | None,
    out_dir: Path,
    live: Path | None = None,
) -> dict:
    driver = None
    if live is not None:
        plans, driver = build_live(settings, live)
    else:
        # Parse the whole trace selection first: a malformed line fails before any engine starts.
        plans = list(build_plans(settings, traces, synthetic))
    if not plans:
        raise ValueError("the trace selection is empty (check --trace, --limit and --sample)")
    notes = []
    if live is None and synthetic is None:
        files = files_of_kind(traces, "multiturn")
        notes += repeat_notes(files, "--trace", "its trajectories are in the selection")
    if live is None:  # a live context grows by the tokens the engine makes, within its own limit
        error = context_too_long(plans, LENGTH_HINT)
        if error is not None:
            raise ValueError(error)
    if settings.clock == "virtual" and live is None:  # live calls are the model's, not planned
        error, profile_notes = tool_profile_problems(settings, plans)
        if error is not None:
            raise ValueError(error)
        notes += profile_notes
    launch = build_policy(
        settings.policy, over=settings.overlap_ratio, hedge_quantile=settings.hedge_quantile
    ).launch_count(settings.batch)
    if len(plans) < launch * settings.steps:
        notes.append(
            f"note: {counted(len(plans), 'trajectory')} selected (trace size, --limit, --sample) "
            f"for {counted(settings.steps, 'step')} of --batch {settings.batch} (launching "
            f"{launch} each): "
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
            # begun at the first event (a no-op after it): a check as the run starts (the
            # gateway, --tool-scale on the wall clock) failed under a bar whose end put an empty
            # line before the error
            progress.start()
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
        if state["task"] is not None:  # a step the selection left short of --batch ended at
            # "1/2", as if one trajectory were unfinished: the bar ends at what the step ran
            progress.update(state["task"], total=metrics["completed"] + metrics["failed"])
        state["step"] = metrics["step"] + 1
        state["task"] = None

    try:
        report = await run_rollout(
            settings, iter(plans), out_dir=out_dir, on_event=on_event, on_step=on_step
        )
    finally:
        if progress.live.is_started:  # its stop prints a line break off a terminal, begun or not
            progress.stop()
    report["notes"] = notes + [
        note for note in (lag_note(report), scaled_tools_note(report)) if note is not None
    ]
    # again, with the notes: report.json lacked what `--json` said (a CPU-starved simulator's)
    write_json({k: v for k, v in report.items() if not k.startswith("_")}, out_dir / "report.json")
    return report


def lag_note(report: dict) -> str | None:
    """A note when the simulated engine's timers fired late enough to bend its figures (the CPU
    could not keep up with --time-scale): every mode prints it, `--json` included. It says the lag
    in modelled seconds too, the table's own: at 20x a 0.042 s lag (5% of a 0.8 s run, enough
    for the note) read "fell 0.0 s behind"."""
    scale = report.get("time_scale", 1.0)
    wall_makespan = max(report["summary"].get("total_makespan_s", 0) / scale, 1e-9)
    lag = report.get("sim_lag_s", 0)
    if lag <= 0.05 * wall_makespan:  # both wall seconds
        return None
    return (
        f"note: the simulator fell {lag:.2g} s ({lag * scale:.3g} s modelled, "
        f"{lag / wall_makespan:.0%} of the run) behind its cost model (CPU starved); lower "
        "--time-scale for faithful timings"
    )


def scaled_tools_note(report: dict) -> str | None:
    """A note when `--time-scale` multiplied the gateway's own round trip into the modelled tool
    times: at 20x a 2 ms round trip is 40 ms modelled, and a 64-trajectory step's tool waits
    came out at twice their recorded latencies (the step 12% longer), with no word of it."""
    scale = report.get("time_scale", 1.0)
    calls = [
        call
        for record in report.get("_records", [])
        for call in record.tool_calls
        if call.status == "success" and call.recorded_latency_s is not None
    ]
    if scale <= 1 or not calls:
        return None
    recorded = sum(call.recorded_latency_s for call in calls)
    modelled = sum(call.latency_s for call in calls) * scale
    if modelled <= 1.1 * recorded:
        return None
    round_trip_ms = (modelled - recorded) / scale / len(calls) * 1e3
    return (
        f"note: the tool calls took {modelled:.3g} s, modelled, where the trace recorded "
        f"{recorded:.3g} s: each call's {round_trip_ms:.1f} ms beyond its delay (the round trip "
        f"through the gateway) is multiplied by --time-scale {scale:g} too; lower --time-scale "
        "for faithful tool timings"
    )
