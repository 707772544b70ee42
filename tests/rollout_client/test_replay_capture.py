"""The docs' round trip: a gateway capture, converted by `trace-to-multiturn`, replayed by
`rollout run --trace` through the search emulator. The capture records no token counts, so the
replay had sent `response_tokens: 0`, which the emulator refuses (it takes 1 or more): every
call of the replay came back a 422 and the trajectories went on with error observations."""

from __future__ import annotations

import json
from pathlib import Path

from emulators.search.router import SearchCall
from gateway.trace import to_multiturn
from rollout_client.gateway_client import _error_with_reason
from rollout_client.workloads.replay import LengthScale, replay_plans
from rollout_client.workloads.synthetic import synthetic_plans


def _capture(path: Path) -> None:
    calls = [("t-1", 0, 0.05, "success"), ("t-1", 1, 0.3, "timeout"), ("t-2", 0, 0.1, "success")]
    with path.open("w") as f:
        for tid, turn, latency, status in calls:
            record = {"turn": turn, "tool_name": "search", "latency_s": latency, "status": status}
            record.update(trajectory_id=tid, step=0, response_bytes=120)
            f.write(json.dumps(record) + "\n")


def test_a_converted_capture_replays_as_calls_the_emulator_takes(tmp_path: Path) -> None:
    _capture(tmp_path / "capture.jsonl")
    to_multiturn(tmp_path / "capture.jsonl", tmp_path / "mt.jsonl")
    for exact in (False, True):
        plans = list(replay_plans([tmp_path / "mt.jsonl"], exact=exact))
        calls = [c for p in plans for t in p.turns for c in t.calls]
        assert len(calls) == 3
        for call in calls:
            SearchCall.model_validate(call.arguments)  # a 422 at the emulator before
            assert call.append_tokens == 0  # the context grows as recorded: by nothing


def test_a_tool_response_capped_at_zero_tokens_is_still_a_call_the_emulator_takes(
    polytrace_dir: Path,
) -> None:
    """`--max-append 0` (replay and synthetic) sent `response_tokens: 0` on every call too."""
    none = LengthScale(max_append=0)
    trace = polytrace_dir / "search_r1" / "multiturn_workload_step_0.jsonl"
    params = polytrace_dir / "intern_s1" / "enhanced_task_distribution_parameters.json"
    plans = [*replay_plans([trace], scale=none, limit=8), *synthetic_plans(params, 8, scale=none)]
    calls = [c for p in plans for t in p.turns for c in t.calls]
    assert calls
    for call in calls:
        SearchCall.model_validate(call.arguments)
        assert call.append_tokens == 0


def test_a_tools_422_names_its_field_whether_or_not_its_loc_starts_with_body() -> None:
    """sandboxd's 422 says `"loc": ["code"]` (FastAPI's says `["body", "code"]`): the reason
    dropped the first element of either, so a replayed capture's sandbox calls were noted as
    "tool 'sandbox' answered HTTP 422: : Field required", naming no field."""
    error = "tool 'sandbox' answered HTTP 422"
    for loc in (["code"], ["body", "code"]):
        detail = [{"type": "missing", "loc": loc, "msg": "Field required"}]
        body = {"status": "error", "error": error, "result": {"detail": detail}}
        assert _error_with_reason(body) == f"{error}: code: Field required"
