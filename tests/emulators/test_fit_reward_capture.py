"""The round trip for reward: calls captured by the gateway, converted, fitted with `--tool reward`
and served by the reward emulator. The capture keeps no batch size, and the emulator scales a
draw by a call's batch_size over the profile's reference batch (64 when unset), so the same call
of 1 response was answered 64 times sooner than recorded, and nothing said so."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from toolenv.cli import build_app

runner = CliRunner()
app = build_app()


def test_a_reward_fit_on_calls_without_batch_sizes_says_how_the_emulator_scales_them(
    tmp_path: Path, polytrace_dir: Path
) -> None:
    capture = tmp_path / "capture.jsonl"
    lines = [
        {"turn": i, "tool_name": "reward", "latency_s": 0.6 + 0.1 * i, "status": "success"}
        | {"trajectory_id": f"t{i % 2}", "step": 0, "response_bytes": 80}
        for i in range(6)
    ]
    capture.write_text("".join(json.dumps(line) + "\n" for line in lines))
    trace = tmp_path / "trace.jsonl"
    converted = runner.invoke(app, ["gateway", "trace-to-multiturn", str(capture), str(trace)])
    assert converted.exit_code == 0, converted.output
    out = tmp_path / "reward.yaml"
    result = runner.invoke(
        app, ["emulators", "fit", str(trace), "--tool", "reward", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "note: 6 reward call(s) record no batch size" in said, said
    assert "set reference.batch_size in the profile" in said
    rllm = runner.invoke(
        app, ["emulators", "fit", str(polytrace_dir / "rllm_deepcoder"), "--tool", "reward"]
    )
    assert rllm.exit_code == 0, rllm.output
    assert "record no batch size" not in rllm.output  # reward timings carry their batch
