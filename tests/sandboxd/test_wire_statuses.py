"""A step's `status` on the wire is one of SandboxFusion's three, whatever limit ended it.

SandboxFusion's own client (the `sandbox-fusion` package) reads each answer into its models,
whose step status is an enum of `Finished`, `Error` and `TimeLimitExceeded`: the memory and
output limits' own statuses (`MemoryLimitExceeded`, `OutputLimitExceeded`) failed it with a
ValidationError, and its retries ran the program five times. `limit` names the limit instead.
"""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel
from sbx_support import SandboxdServer, post

pytestmark = pytest.mark.bwrap


class SandboxFusionStep(BaseModel):
    """The step as SandboxFusion's client models it (its `CommandRunResult`)."""

    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class SandboxFusionAnswer(BaseModel):
    """SandboxFusion's client's `RunCodeResponse`."""

    status: Literal["Success", "Failed", "SandboxError"]
    message: str
    compile_result: SandboxFusionStep | None = None
    run_result: SandboxFusionStep | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = {}


MEMORY_BOMB = "a = []\nwhile True:\n    a.append(bytearray(16 * 2**20))\n"
FLOOD = "import sys, time\nsys.stdout.write('x' * 5000)\nsys.stdout.flush()\ntime.sleep(5)\n"


@pytest.mark.parametrize(
    ("code", "fields", "limit"),
    [
        (MEMORY_BOMB, {"memory_limit_MB": 128}, "memory"),
        (FLOOD, {"max_output_bytes": 1000}, "output"),
    ],
)
def test_a_limit_kill_is_finished_with_its_return_code(
    api: SandboxdServer, code: str, fields: dict, limit: str
) -> None:
    res = api.run_code(code=code, run_timeout=10, **fields)
    answer = SandboxFusionAnswer.model_validate(res)  # raised for the limit's own status
    assert answer.status == "Failed", res
    assert answer.run_result is not None and answer.run_result.status == "Finished", res
    assert answer.run_result.return_code == -9, res  # killed at the limit
    assert res["run_result"]["limit"] == limit, res
    assert res["message"] == res["run_result"]["message"] != "", res  # which limit, in words


def test_limit_says_time_and_none(api: SandboxdServer) -> None:
    res = api.run_code(code="import time; time.sleep(5)", run_timeout=0.3)
    SandboxFusionAnswer.model_validate(res)
    assert res["run_result"]["status"] == "TimeLimitExceeded", res
    assert res["run_result"]["limit"] == "time", res
    res = api.run_code(code="raise SystemExit(3)")
    assert res["run_result"]["status"] == "Finished", res
    assert res["run_result"]["limit"] is None, res


def test_run_tests_verdicts_still_name_the_limit(api: SandboxdServer) -> None:
    body = {
        "code": MEMORY_BOMB,
        "language": "python",
        "memory_limit_MB": 128,
        "cases": [{"expected_stdout": ""}],
    }
    res = post(api, body, "/v1/run_tests").json()
    assert res["verdict"] == "memory_limit", res
    case = res["cases"][0]["run_result"]
    assert case["status"] == "Finished" and case["limit"] == "memory", res
