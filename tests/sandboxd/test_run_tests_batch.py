"""`/v1/run_tests` on the fork server: one runner per request forks a fresh process per case.

- every case of a corpus (pass, wrong answer, runtime error, time, memory and output limits,
  stdin, files in /tmp and the run dir, exit codes, signals) gets the same verdict and the same
  observable result as on the per-case paths (a runner per case; a fresh `python3 main.py`);
- nothing of one case is visible to the next case of the same request: files in /tmp, /dev/shm
  and the run dir, background processes, module state;
- a fork bomb and an endless loop in one request are contained, the other cases still pass,
  and nothing is left behind (processes, cgroups, run dirs, mounts);
- the mode: one fork of the zygote per request; the per-case path when batches are off, and
  for a request beyond `max_concurrency` open runners (counted in the status).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from sbx_support import SandboxdServer

from sandboxd.service import SandboxService
from sandboxd.settings import SandboxSettings
from sandboxd.wire import RunTestsRequest, RunTestsResponse
from sandboxd.wire import TestCase as Case
from toolenv_core.deadline import Deadline

pytestmark = pytest.mark.bwrap

# One program, a behaviour per first line of stdin.
JUDGE = r"""
import os, sys, time
what = sys.stdin.readline().strip()
if what == "square":
    n = int(sys.stdin.readline()); print(n * n)
elif what == "wrong":
    print(-1)
elif what == "raise":
    raise ValueError("boom")
elif what == "exit3":
    print("partial"); sys.exit(3)
elif what == "exit_msg":
    sys.exit("a message")
elif what == "segv":
    import ctypes; sys.stdout.flush(); ctypes.string_at(0)  # a real fault (PID 1 ignores kill)
elif what == "sleep":
    time.sleep(30)
elif what == "spin":
    while True: pass
elif what == "memory":
    blocks = [bytearray(2**20) for _ in range(400)]
elif what == "flood":
    while True: sys.stdout.write("y" * 65536)
elif what == "echo_all":
    data = sys.stdin.read(); print(len(data), data.count("\n"), data[-20:])
elif what == "files":
    for d in ("/tmp", ".", "/dev/shm"):
        with open(os.path.join(d, "out.txt"), "w") as f:
            f.write(d * 3)
    print([open(os.path.join(d, "out.txt")).read() for d in ("/tmp", ".", "/dev/shm")])
    print(sorted(os.listdir(".")), open("data/input.txt").read())
elif what == "identity":
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    print(os.getuid(), os.getgid(), *(status[k].strip() for k in ("CapEff", "CapBnd", "NoNewPrivs")))
    print(__name__, sys.argv, os.getcwd(), sorted(os.listdir("/tmp")), os.getpid())
elif what == "stderr":
    print("to stderr", file=sys.stderr); print("to stdout")
"""

CORPUS = [
    ("square\n7\n", "49\n"),
    ("wrong\n", "49\n"),
    ("raise\n", None),
    ("exit3\n", None),
    ("exit_msg\n", None),
    ("segv\n", None),
    ("sleep\n", None),
    ("spin\n", None),
    ("memory\n", None),
    ("flood\n", None),
    ("echo_all\n" + "line of input\n" * 5000, None),
    ("files\n", None),
    ("identity\n", None),
    ("stderr\n", "to stdout\n"),
]
FILES = {"data/input.txt": "ZGF0YSBmaWxl"}  # "data file"


def request(code: str, cases: list[tuple[str, str | None]], **kw: object) -> RunTestsRequest:
    return RunTestsRequest(
        code=code,
        language="python",
        cases=[Case(stdin=s, expected_stdout=e) for s, e in cases],
        **{"timeout": 1.5, "memory_limit_MB": 128, "max_output_bytes": 100_000, **kw},
    )


async def run_on(req: RunTestsRequest, **settings: object) -> tuple[RunTestsResponse, dict]:
    service = SandboxService(SandboxSettings(max_concurrency=4, **settings))
    await service.start()
    try:
        response = await service.run_tests(req, Deadline.after(120))
        return response, service.status()
    finally:
        await service.close()


def observable(response: RunTestsResponse) -> list[tuple[object, ...]]:
    out = []
    for c in response.cases:
        r = c.run_result
        assert r is not None
        out.append((c.verdict, r.status, r.return_code, r.signal, r.stdout, r.stderr, r.truncated))
    return out


async def test_the_corpus_gets_the_same_results_as_on_the_per_case_paths(
    bwrap_path: str,
) -> None:
    req = request(JUDGE, CORPUS, files=FILES)
    batched, status = await run_on(req)
    assert status["python_mode"] == "fork_server"
    assert status["run_tests_batches"]["total"] == 1
    assert status["fork_server"]["forks"] == 2  # the start-up probe, then the request's runner
    per_runner, status = await run_on(req, fork_server_batch=False)
    assert status["run_tests_batches"]["total"] == 0
    assert status["fork_server"]["forks"] == 1 + len(CORPUS)
    spawned, status = await run_on(req, fork_server=False)
    assert status["python_mode"] == "warm_spawn"
    verdicts = [c.verdict for c in batched.cases]
    assert verdicts == [
        "accepted",
        "wrong_answer",
        *["runtime_error"] * 4,
        "time_limit",
        "time_limit",
        "memory_limit",
        "output_limit",
        *["accepted"] * 3,
        "accepted",
    ]
    got = observable(batched)
    for name, reference in (("runner per case", per_runner), ("fresh python3", spawned)):
        differences = [
            f"{CORPUS[i][0][:12]!r}:\n  batch: {a}\n  {name}: {b}"
            for i, (a, b) in enumerate(zip(got, observable(reference), strict=True))
            if a != b
        ]
        assert not differences, "\n".join(differences)
    files = batched.cases[11].run_result
    assert files is not None and "data file" in files.stdout and "/tmp/tmp/tmp" in files.stdout
    identity = batched.cases[12].run_result
    assert identity is not None
    zero = "0000000000000000"
    assert identity.stdout.splitlines() == [
        f"65534 65534 {zero} {zero} 1",
        "__main__ ['main.py'] /sandbox [] 1",
    ]


WRITER_OR_CHECKER = r"""
import builtins, json, os, subprocess, sys, time
if input() == "write":
    for d in ("/tmp", "/dev/shm", "/sandbox"):
        open(os.path.join(d, "planted"), "w").write("x")
    builtins.polluted = True
    json.dumps = None
    sys.modules["planted"] = sys
    subprocess.Popen(["/usr/bin/sleep", "30"], start_new_session=True)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(30)
        os._exit(0)
    time.sleep(0.05)
    print("planted", sorted(p for p in os.listdir("/proc") if p.isdigit()) != ["1"])
else:
    print(sorted(os.listdir("/tmp")), sorted(os.listdir("/dev/shm")), sorted(os.listdir(".")))
    print(hasattr(builtins, "polluted"), json.dumps([1]), "planted" in sys.modules)
    print(sorted(p for p in os.listdir("/proc") if p.isdigit()))
"""


@pytest.mark.parametrize("userns", [False, True], ids=["root", "user-namespace"])
async def test_nothing_of_one_case_is_visible_to_the_next(
    bwrap_path: str, userns: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cases one at a time (concurrency 1): the writer's files, processes and module state
    are gone before each checker starts. Also in the user-namespace mode (a compose service)."""
    if userns:
        monkeypatch.setattr("sandboxd.process.forkserver.needs_user_namespace", lambda: True)
    cases = [("write\n", None), ("check\n", None), ("write\n", None), ("check\n", None)]
    response, status = await run_on(request(WRITER_OR_CHECKER, cases, concurrency=1))
    assert status["run_tests_batches"]["total"] == 1
    assert status["fork_server"]["user_namespace"] is userns
    outs = [c.run_result.stdout if c.run_result else None for c in response.cases]
    clean = "[] [] ['main.py']\nFalse [1] False\n['1']\n"
    assert outs == ["planted True\n", clean, "planted True\n", clean], outs


HOSTILE = r"""
import os, sys
what = input()
if what == "forkbomb":
    while True:
        try:
            os.fork()
        except OSError:
            pass
elif what == "loop":
    while True:
        pass
else:
    print(int(what) * 2)
"""


async def test_beyond_the_open_runners_a_request_takes_the_per_case_path(
    bwrap_path: str,
) -> None:
    """max_concurrency 1: while one request holds the only runner a second one, concurrent,
    runs its cases a runner each; both get every verdict right."""
    service = SandboxService(SandboxSettings(max_concurrency=1))
    await service.start()
    try:
        req = request(JUDGE, [("square\n3\n", "9\n"), ("wrong\n", "9\n")] * 3)
        forks = service.status()["fork_server"]["forks"]
        responses = await asyncio.gather(
            service.run_tests(req, Deadline.after(60)), service.run_tests(req, Deadline.after(60))
        )
        status = service.status()
    finally:
        await service.close()
    for response in responses:
        assert [c.verdict for c in response.cases] == ["accepted", "wrong_answer"] * 3
    batches = status["run_tests_batches"]
    assert (batches["open"], batches["total"], batches["fallbacks"]) == (0, 1, 1), batches
    assert "hold a runner" in batches["last_fallback"]
    assert status["fork_server"]["forks"] - forks == 1 + 6  # one runner, six per-case runs


@pytest.fixture(scope="module")
def server(sandboxd_factory: Callable[..., SandboxdServer]) -> SandboxdServer:
    server = sandboxd_factory("--max-concurrency", "4")
    server.run_code(code="print(1)")  # warm the first-run paths before the baseline
    return server


def test_a_fork_bomb_and_a_loop_are_contained_and_nothing_is_left(
    server: SandboxdServer,
) -> None:
    server.probe.baseline()
    cases = [
        {"stdin": "forkbomb\n"},
        {"stdin": "1\n", "expected_stdout": "2\n"},
        {"stdin": "loop\n"},
        {"stdin": "2\n", "expected_stdout": "4\n"},
        *[{"stdin": f"{n}\n", "expected_stdout": f"{2 * n}\n"} for n in range(3, 12)],
    ]
    body = {"code": HOSTILE, "language": "python", "cases": cases, "timeout": 2}
    r = server.client.post("/v1/run_tests", json=body)
    assert r.status_code == 200, r.text
    res = r.json()
    verdicts = [c["verdict"] for c in res["cases"]]
    assert verdicts[0] == "time_limit" and verdicts[2] == "time_limit", verdicts
    assert verdicts[1] == verdicts[3] == "accepted" and res["passed"] == len(cases) - 2
    status = server.client.get("/v1/sandbox/status").json()
    batches = status["run_tests_batches"]
    assert (batches["open"], batches["total"], batches["fallbacks"]) == (0, 1, 0), batches
    server.probe.assert_clean()  # no process, cgroup task, run dir or mount of the request
