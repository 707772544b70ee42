"""`POST /v1/run_tests`: one program against many cases, a verdict per case (real server)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest
from sbx_support import SandboxdServer

pytestmark = pytest.mark.bwrap

# Reads "n", then misbehaves on purpose for some inputs.
JUDGED = """
import sys, time
n = int(sys.stdin.readline())
if n == 3:
    print(999)            # wrong answer
elif n == 4:
    time.sleep(30)        # time limit
elif n == 5:
    raise ValueError(n)   # runtime error
elif n == 6:
    a = bytearray(400 * 2**20)  # memory limit
elif n == 7:
    while True: sys.stdout.write('y' * 65536)  # output limit
else:
    print(n * n)
"""


@pytest.fixture(scope="module")
def server(sandboxd_factory: Callable[..., SandboxdServer]) -> SandboxdServer:
    return sandboxd_factory("--max-concurrency", "4")


def run_tests(server: SandboxdServer, **body: object) -> dict:
    r = server.client.post("/v1/run_tests", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_verdict_per_case_and_the_pass_fraction(server: SandboxdServer) -> None:
    server.probe.baseline()
    cases = [{"stdin": f"{n}\n", "expected_stdout": f"{n * n}\n"} for n in range(1, 8)]
    res = run_tests(
        server,
        code=JUDGED,
        language="python",
        cases=cases,
        timeout=2,
        memory_limit_MB=128,
        max_output_bytes=100_000,
    )
    verdicts = [c["verdict"] for c in res["cases"]]
    assert verdicts == [
        "accepted",
        "accepted",
        "wrong_answer",
        "time_limit",
        "runtime_error",
        "memory_limit",
        "output_limit",
    ]
    assert res["passed"] == 2 and res["total"] == 7
    assert res["pass_fraction"] == pytest.approx(2 / 7)
    assert res["verdict"] == "wrong_answer"  # the first failure
    assert res["cases"][4]["run_result"]["stderr"].rstrip().endswith("ValueError: 5")
    server.probe.assert_clean()  # nothing of those runs is left


def test_all_accepted_with_comparison_modes(server: SandboxdServer) -> None:
    code = "print(*input().split())\nprint()  "
    cases = [
        {"stdin": "1 2 3", "expected_stdout": "1 2 3"},
        {"stdin": "4", "expected_stdout": "4\n\n\n"},
    ]
    res = run_tests(server, code=code, cases=cases)
    assert res["verdict"] == "accepted" and res["pass_fraction"] == 1.0
    res = run_tests(server, code=code, cases=cases, comparison="exact")
    assert [c["verdict"] for c in res["cases"]] == ["wrong_answer", "wrong_answer"]
    res = run_tests(
        server, code="print('1\\n 2')", cases=[{"expected_stdout": "1 2"}], comparison="tokens"
    )
    assert res["verdict"] == "accepted"


def test_cases_run_concurrently(server: SandboxdServer) -> None:
    cases = [{"stdin": "", "expected_stdout": "ok"} for _ in range(4)]
    started = time.monotonic()
    res = run_tests(server, code="import time; time.sleep(1.5); print('ok')", cases=cases)
    elapsed = time.monotonic() - started
    assert res["passed"] == 4
    assert elapsed < 5.5  # one after the other would take at least 6 s


def test_stop_at_the_first_failure_skips_the_rest(server: SandboxdServer) -> None:
    cases = [{"stdin": "3\n", "expected_stdout": "9\n"}] + [
        {"stdin": "1\n", "expected_stdout": "1\n"} for _ in range(20)
    ]
    res = run_tests(server, code=JUDGED, cases=cases, stop_on_first_failure=True, concurrency=1)
    assert res["cases"][0]["verdict"] == "wrong_answer"
    assert all(c["verdict"] == "skipped" for c in res["cases"][1:])
    assert res["verdict"] == "wrong_answer" and res["passed"] == 0


def test_compile_error_is_one_verdict_for_the_program(server: SandboxdServer) -> None:
    res = run_tests(server, code="int main( {", language="c", cases=[{"expected_stdout": "x"}] * 3)
    assert res["verdict"] == "compile_error"
    assert res["compile_result"]["return_code"] != 0
    assert res["passed"] == 0


def test_a_compile_a_time_limit_ended_is_every_cases_time_limit(server: SandboxdServer) -> None:
    """A compile cut by the request's deadline (or one that never started: the deadline ran
    out in the queue) read `compile_error` for every case, the program's fault, where the
    gateway answers the same deadline `time_limit`; so does a compile over compile_timeout."""
    body = {
        "code": '#include <stdio.h>\nint main(){puts("1");}',
        "language": "c",
        "cases": [{"expected_stdout": "1"}] * 2,
    }
    for headers, extra in (({"X-Toolenv-Deadline-Ms": "1"}, {}), ({}, {"compile_timeout": 0.01})):
        r = server.client.post("/v1/run_tests", json={**body, **extra}, headers=headers)
        res = r.json()
        assert r.status_code == 200 and res["compile_result"]["status"] == "TimeLimitExceeded", res
        assert res["verdict"] == "time_limit", res
        assert [c["verdict"] for c in res["cases"]] == ["time_limit"] * 2
        assert res["message"] == res["compile_result"]["message"] != "", res
    assert r.headers.get("x-toolenv-deadline-expired") is None  # its own compile_timeout


def test_cpp_cases(server: SandboxdServer) -> None:
    code = "#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a+b<<std::endl;}"
    cases = [{"stdin": f"{i} {i}", "expected_stdout": str(2 * i)} for i in range(3)]
    compiles = server.client.get("/v1/sandbox/status").json()["compiles_total"]
    res = run_tests(server, code=code, language="cpp", cases=cases, compile_timeout=30)
    assert res["verdict"] == "accepted", res
    assert res["compile_result"]["status"] == "Finished"
    # compiled once for the request; every case ran the binary in its own sandbox
    assert server.client.get("/v1/sandbox/status").json()["compiles_total"] == compiles + 1
    cases = [{"stdin": "", "expected_stdout": "0"}] * 2
    code = "int main(){ int *p = 0; return *p; }"
    res = run_tests(server, code=code, language="c", cases=cases)
    assert [c["verdict"] for c in res["cases"]] == ["runtime_error", "runtime_error"]


# A program whose binary (20 MB of initialised data) is over the artifact a compile brings
# back (`max_output_bytes`, 16 MiB): a valid program all the same.
BIG_BINARY = (
    "#include <stdio.h>\nchar big[20 << 20] = {1};\n"
    'int main(){int x; if (scanf("%d", &x) != 1) return 2; printf("%d\\n", 2 * x + big[0] - 1);}\n'
)


def test_a_binary_over_the_artifact_cap_is_compiled_per_case(server: SandboxdServer) -> None:
    """The compile succeeded but its artifact could not be brought back: every case read
    compile_error, with a compile_result that exited 0 and no message why."""
    cases = [{"stdin": str(i), "expected_stdout": str(2 * i)} for i in range(3)]
    res = run_tests(server, code=BIG_BINARY, language="c", cases=cases, compile_timeout=30)
    assert [c["verdict"] for c in res["cases"]] == ["accepted"] * 3, res
    assert res["compile_result"]["return_code"] == 0


@pytest.mark.parametrize(
    "body,status",
    [
        ({"code": "print(1)", "cases": []}, 422),
        ({"code": "print(1)", "language": "cobol", "cases": [{}]}, 400),
        ({"code": "print(1)", "cases": [{"timeout": 10_000}]}, 422),
        ({"cases": [{}]}, 422),
    ],
)
def test_bad_run_tests_requests(server: SandboxdServer, body: dict, status: int) -> None:
    assert server.client.post("/v1/run_tests", json=body).status_code == status


def test_a_null_file_is_refused_naming_it(server: SandboxdServer) -> None:
    """toolenv's own route takes no null content (it was an empty file, silently)."""
    body = {"code": "print(1)", "cases": [{}], "files": {"ok.txt": "", "data.txt": None}}
    r = server.client.post("/v1/run_tests", json=body)
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["files", "data.txt"] and "string" in error["msg"]


def test_a_case_with_misnamed_fields_is_refused_not_accepted(server: SandboxdServer) -> None:
    # `input`/`output` (a common dataset naming) would otherwise be dropped, leaving a case with
    # no expected output that any program exiting 0 passes: a reward of 1 for a wrong program.
    body = {"code": "print(3)", "cases": [{"input": "1 2", "output": "4"}]}
    r = server.client.post("/v1/run_tests", json=body)
    assert r.status_code == 422, r.text
    (error,) = r.json()["detail"]
    assert error["loc"] == ["cases", 0]
    assert error["msg"].startswith("unknown case field(s) 'input', 'output'; a case has stdin")
    assert "expected_stdout" in error["msg"]


def test_the_answer_carries_a_bounded_amount_of_output(
    sandboxd_factory: Callable[..., SandboxdServer],
) -> None:
    """Each case may print up to its cap: 1,000 cases at 16 MiB were a 16 GB answer, held
    three times over in the service's memory. Verdicts still judge the whole output."""
    server = sandboxd_factory(
        "--max-concurrency", "2", env={"TOOLENV_SANDBOX_MAX_RUN_TESTS_OUTPUT_BYTES": "100000"}
    )
    out = "x" * 30_000 + "\n"
    res = run_tests(
        server,
        code="print('x' * 30_000)",
        cases=[{"expected_stdout": out}] * 6,
        concurrency=1,
    )
    assert res["verdict"] == "accepted" and res["passed"] == 6
    runs = [c["run_result"] for c in res["cases"]]
    assert sum(len(r["stdout"]) for r in runs) == 100_000
    assert [r["stdout_truncated"] for r in runs] == [False] * 3 + [True] * 3
    assert [len(r["stdout"]) for r in runs[3:]] == [100_000 - 3 * len(out), 0, 0]
    assert "stdout cut: the answer carries 100000 bytes of output" in runs[3]["message"]


def test_a_case_kept_waiting_past_the_queue_timeout_keeps_the_verdicts_of_the_others(
    sandboxd_factory: Callable[..., SandboxdServer],
) -> None:
    """One slot, `queue_timeout_s` 2 s: while the request's first case runs (1 s), another
    caller's 4 s run queues and takes the slot next, so the second case waits 4 s. That was a 429
    for the whole request: the first case's verdict thrown away, and the caller ran it again.
    A request that has a verdict waits on, bounded by its deadline only."""
    server = sandboxd_factory(
        "--max-concurrency", "1", env={"TOOLENV_SANDBOX_QUEUE_TIMEOUT_S": "2"}
    )  # fmt: skip
    answers: dict[str, httpx.Response] = {}

    def send(name: str, path: str, body: dict) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            answers[name] = client.post(path, json=body)

    def admission() -> dict:
        return server.client.get("/v1/sandbox/status").json()["admission"]

    program = "import time\ntime.sleep(float(input()))\nprint('ok')"
    cases = [{"stdin": s, "expected_stdout": "ok\n"} for s in ("1\n", "0\n")]
    body = {"code": program, "language": "python", "cases": cases, "concurrency": 1}
    tests = threading.Thread(target=send, args=("tests", "/v1/run_tests", body))
    tests.start()
    _until(lambda: admission()["running"] == 1)  # the first case holds the only slot
    other = {"code": "import time; time.sleep(4); print('done')"}
    run = threading.Thread(target=send, args=("run", "/run_code", other))
    run.start()
    _until(lambda: admission()["waiting"] == 1)  # queued before the second case
    tests.join(30)
    run.join(30)
    r = answers["tests"]
    assert r.status_code == 200, r.text
    assert [c["verdict"] for c in r.json()["cases"]] == ["accepted", "accepted"], r.text
    assert answers["run"].status_code == 200, answers["run"].text
    assert answers["run"].json()["run_result"]["stdout"] == "done\n", answers["run"].text
    assert admission()["rejected_total"] == 0


def _until(condition: Callable[[], bool], timeout: float = 10) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "the condition did not hold in time"
        time.sleep(0.02)
