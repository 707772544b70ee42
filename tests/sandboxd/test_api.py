"""The sandboxd HTTP API on a real server (process backend, real bwrap, loopback HTTP)."""

from __future__ import annotations

import base64
import re
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from sbx_support import SandboxdServer, post

pytestmark = pytest.mark.bwrap

SANDBOXFUSION_FIELDS = {
    "status",
    "message",
    "compile_result",
    "run_result",
    "executor_pod_name",
    "files",
}
RESULT_FIELDS = {"status", "execution_time", "return_code", "stdout", "stderr"}

HELLO = {
    "python": "print('hello', input())",
    "bash": "read x\necho hello $x",
    "c": '#include <stdio.h>\nint main(){char b[64];scanf("%63s",b);printf("hello %s\\n",b);return 0;}',
    "cpp": '#include <iostream>\n#include <string>\nint main(){std::string s;std::cin>>s;std::cout<<"hello "<<s<<"\\n";}',
}


PWNAME_C = r"""#include <grp.h>
#include <pwd.h>
#include <stdio.h>
#include <unistd.h>
int main(void) {
  struct passwd *p = getpwuid(getuid());
  struct group *g = getgrgid(getgid());
  printf("%s %s\n", p ? p->pw_name : "?", g ? g->gr_name : "?");
  return 0;
}
"""


# ---------------------------------------------------------------- small endpoints


def test_ping_languages_status(api: SandboxdServer) -> None:
    assert api.client.get("/v1/ping").json() == "pong"
    head = api.client.head("/readyz")  # load balancers probe with HEAD (it was a 405)
    assert head.status_code == 200 and head.content == b""
    langs = {lang["name"]: lang for lang in api.client.get("/v1/languages").json()["languages"]}
    assert set(langs) == {"python", "bash", "c", "cpp"}
    assert langs["cpp"]["compiled"] and not langs["python"]["compiled"]
    status = api.client.get("/v1/sandbox/status").json()
    assert status["backend"] == "process" and status["isolation"] == "bubblewrap"
    assert status["admission"]["capacity"] == 4
    assert set(status["cgroups"]) >= {"pids", "memory"}


# ---------------------------------------------------------------- languages


@pytest.mark.parametrize("language", ["python", "bash", "c", "cpp"])
def test_every_language_runs_with_stdin(api: SandboxdServer, language: str) -> None:
    res = api.run_code(code=HELLO[language], language=language, stdin="world\n", compile_timeout=30)
    assert set(res) >= SANDBOXFUSION_FIELDS
    assert res["status"] == "Success", res
    assert set(res["run_result"]) >= RESULT_FIELDS
    assert res["run_result"]["stdout"] == "hello world\n"
    assert res["run_result"]["return_code"] == 0
    assert (res["compile_result"] is not None) == (language in ("c", "cpp"))
    # bash, C and C++ run under bwrap's init: their CPU time is their cgroup's
    # (test_cpu_time_of_c_and_bash_is_their_cgroups)
    assert res["run_result"]["cpu_time"] is not None
    assert res["run_result"]["peak_memory_kb"] is not None


def test_compile_timeout_is_separate_from_run_timeout(api: SandboxdServer) -> None:
    res = api.run_code(code=HELLO["cpp"], language="cpp", compile_timeout=0.05, run_timeout=10)
    assert res["status"] == "Failed"
    assert res["compile_result"]["status"] == "TimeLimitExceeded"
    assert res["run_result"] is None
    # the limit's words, as /v1/run_tests says them: it read "compilation failed" (the code's)
    assert res["message"] == res["compile_result"]["message"]
    assert res["message"] == "wall-clock limit of 0.05 s exceeded", res
    code = "int main(){volatile unsigned long i=0; for(;;) i++;}"
    res = api.run_code(code=code, language="c", compile_timeout=30, run_timeout=0.5)
    assert res["compile_result"]["status"] == "Finished"
    assert res["compile_result"]["return_code"] == 0
    assert res["run_result"]["status"] == "TimeLimitExceeded"
    assert 0.4 < res["run_result"]["execution_time"] < 3


def test_an_output_cap_says_whether_it_killed_the_program(api: SandboxdServer) -> None:
    """Output past the cap is the output limit's either way; a program that had exited by itself
    before the service read that output was not killed (it said "the program was killed" beside
    a return_code of 0: which one comes first is a race, so a few runs see both)."""
    slow = "import sys, time; sys.stdout.write('x' * 5000); time.sleep(5)"
    quick = "import sys; sys.stdout.write('x' * 5000)"
    for code in [slow] + [quick] * 5:
        rr = api.run_code(code=code, max_output_bytes=1000)["run_result"]
        assert rr["limit"] == "output" and rr["stdout_truncated"], rr
        assert len(rr["stdout"]) == 1000
        end = "the program was killed" if rr["signal"] else "it had already exited by itself"
        assert rr["message"] == f"stdout exceeded 1000 bytes; {end}", rr
        assert (rr["return_code"] == 0) == (rr["signal"] is None), rr
    assert rr["execution_time"] < 5


def test_output_cut_at_its_cap_drops_the_character_the_cut_split(api: SandboxdServer) -> None:
    """'é' is two bytes: a cap of 1001 keeps 500 of them, not 500 and a U+FFFD (1003 bytes)."""
    code = "import sys; sys.stdout.write('\u00e9' * 1000)"
    rr = api.run_code(code=code, max_output_bytes=1001)["run_result"]
    assert rr["stdout_truncated"] and rr["stdout"] == "\u00e9" * 500, rr["stdout"][-3:]
    res = api.run_code(code="import sys; sys.stdout.buffer.write(b'ok\\xff\\xfe')")
    assert res["run_result"]["stdout"] == "ok\ufffd\ufffd"  # invalid bytes: still replaced


def test_compile_error_and_runtime_signal(api: SandboxdServer) -> None:
    res = api.run_code(code="int main( { return 0; }", language="c")
    assert res["status"] == "Failed" and res["run_result"] is None
    assert res["compile_result"]["return_code"] != 0 and "error" in res["compile_result"]["stderr"]
    res = api.run_code(code="int main(){ volatile int *p = 0; return *p; }", language="c")
    assert res["status"] == "Failed"
    assert res["run_result"]["status"] == "Finished"
    assert res["run_result"]["signal"] == 11 and res["run_result"]["return_code"] == -11
    assert res["message"] == "killed by signal 11 (SIGSEGV)"  # it said "Finished"
    res = api.run_code(code="import sys; print('x'); sys.exit(3)")
    assert res["status"] == "Failed" and res["run_result"]["return_code"] == 3
    assert res["message"] == "exited with code 3"


def test_a_compiled_programs_own_abort_or_signal_ends_it_as_anywhere(api: SandboxdServer) -> None:
    """A C or C++ program, or a shell script, is not the init of its PID namespace (bwrap's init
    is), so the signals it sends itself act as on any machine: a failed assert or an uncaught C++
    exception is SIGABRT (it was SIGSEGV: the kernel spares an init its own signals, and glibc's
    abort then crashes), and `kill -TERM $$` ends a script. Python stays its namespace's init in
    both modes (the fork server's cases are), as docs/sandboxd.md says."""
    code = "#include <assert.h>\nint main(void){ assert(1 == 2); return 0; }"
    res = api.run_code(code=code, language="c")
    assert res["run_result"]["signal"] == 6 and res["run_result"]["return_code"] == -6, res
    assert "Assertion" in res["run_result"]["stderr"]
    assert res["message"] == "killed by signal 6 (SIGABRT)"
    code = '#include <stdexcept>\nint main(){ throw std::runtime_error("boom"); }'
    res = api.run_code(code=code, language="cpp")
    assert res["run_result"]["signal"] == 6, res
    assert "boom" in res["run_result"]["stderr"]
    res = api.run_code(code="echo before\nkill -TERM $$\necho after\n", language="bash")
    assert res["run_result"]["stdout"] == "before\n", res
    assert res["run_result"]["signal"] == 15 and res["run_result"]["return_code"] == -15
    res = api.run_code(code="import os\nprint(os.getpid())")
    assert res["run_result"]["stdout"] == "1\n", res


@pytest.mark.parametrize(
    ("language", "code"),
    [
        ("bash", "whoami; id -gn"),
        (
            "python",
            "import getpass, grp, os\nprint(getpass.getuser(), grp.getgrgid(os.getgid())[0])",
        ),
        ("c", PWNAME_C),
    ],
)
def test_the_program_has_a_user_name(api: SandboxdServer, language: str, code: str) -> None:
    """As in the Docker image, uid 65534 is `nobody` of group `nogroup`: with no /etc/passwd,
    `whoami` and `getpass.getuser()` failed on this backend only (the host's list stays out)."""
    res = api.run_code(code=code, language=language, compile_timeout=30)
    assert res["status"] == "Success", res
    assert res["run_result"]["stdout"].split() == ["nobody", "nogroup"], res["run_result"]


def test_files_in_and_fetch_files_out(api: SandboxdServer) -> None:
    code = (
        "import os\n"
        "data = open('in/data.txt').read()\n"
        "open('out.txt', 'w').write(data.upper())\n"
        "os.symlink('/etc/hostname', 'link')\n"
    )
    res = api.run_code(
        code=code,
        files={"in/data.txt": base64.b64encode(b"abc").decode()},
        fetch_files=["out.txt", "missing.txt", "link"],
    )
    assert res["status"] == "Success", res
    assert res["files"] == {"out.txt": base64.b64encode(b"ABC").decode()}


def test_fetch_files_after_a_failed_compile(api: SandboxdServer) -> None:
    """A compile error still fetches the files asked for, as the Docker agent and SandboxFusion
    do: the process backend answered `files: {}`, the request's own input file left out."""
    res = api.run_code(
        code="int main(void) { return undeclared; }",
        language="c",
        files={"in.txt": base64.b64encode(b"kept").decode()},
        fetch_files=["in.txt", "main"],
    )
    assert res["status"] == "Failed" and res["message"] == "compilation failed", res
    assert res["run_result"] is None
    assert res["files"] == {"in.txt": base64.b64encode(b"kept").decode()}


def test_a_small_max_output_bytes_caps_the_program_not_its_compiler(api: SandboxdServer) -> None:
    """`max_output_bytes` bounds the program's output; its compile keeps the default cap: gcc was
    killed at its first warning longer than 64 bytes, and a valid program "Failed" unrun."""
    code = (
        "#include <stdio.h>\n"
        'int main(void) { char *s = 5; for (int i = 0; i < 50; i++) puts("0123456789"); }'
    )
    res = api.run_code(code=code, language="c", max_output_bytes=64)
    assert res["compile_result"]["return_code"] == 0, res["compile_result"]
    assert "-Wint-conversion" in res["compile_result"]["stderr"]
    assert res["run_result"]["limit"] == "output", res["run_result"]
    assert res["run_result"]["stdout"] == "0123456789\n" * 5 + "0123456789"[:9]


def test_fetch_files_share_one_cap_in_the_order_asked(api: SandboxdServer) -> None:
    """`max_output_bytes` bounds the fetched files together, as on Docker: it was per file, so an
    answer grew with the number of files (250 of 16 MiB from a run with 4 GB of memory)."""
    code = "for name, n in (('a', 3000), ('b', 3000), ('c', 3000), ('d', 1000)):\n"
    code += "    open(name, 'wb').write(name.encode() * n)"
    res = api.run_code(code=code, fetch_files=["a", "b", "c", "d"], max_output_bytes=8000)
    assert res["status"] == "Success", res
    # c is larger than the 2000 bytes left: left out; d still fits
    assert {k: len(base64.b64decode(v)) for k, v in res["files"].items()} == {
        "a": 3000,
        "b": 3000,
        "d": 1000,
    }


def test_files_in_base64_wrapped_in_lines(api: SandboxdServer) -> None:
    """`base64` and `base64.encodebytes` wrap at 76 characters; SandboxFusion reads that (it
    was a 422 here: "Excess data after padding" / "Only base64 data is allowed")."""
    data = bytes(range(256)) * 2
    code = "import sys\nsys.stdout.write(open('blob', 'rb').read().hex())"
    res = api.run_code(code=code, files={"blob": base64.encodebytes(data).decode()})
    assert res["status"] == "Success", res
    assert res["run_result"]["stdout"] == data.hex()


def test_a_null_file_content_writes_no_file_as_in_sandboxfusion(api: SandboxdServer) -> None:
    """SandboxFusion's `files` is `Dict[str, Optional[str]]` and it skips a null content: no file
    (it was an empty file here). `""` is the empty file."""
    code = "import os\nprint(sorted(os.listdir('.')))"
    res = api.run_code(code=code, files={"gone.txt": None, "empty.txt": ""})
    assert res["status"] == "Success", res
    assert "empty.txt" in res["run_result"]["stdout"]
    assert "gone.txt" not in res["run_result"]["stdout"]


# ---------------------------------------------------------------- deadlines, clients that leave


def test_deadline_header_bounds_the_whole_call(api: SandboxdServer) -> None:
    started = time.monotonic()
    r = post(
        api,
        {"code": "import time; print('a', flush=True); time.sleep(30)", "run_timeout": 30},
        headers={"X-Toolenv-Deadline-Ms": "800"},
    )
    elapsed = time.monotonic() - started
    assert r.status_code == 200
    assert r.json()["run_result"]["status"] == "TimeLimitExceeded"
    assert r.json()["run_result"]["stdout"] == "a\n"
    assert elapsed < 5


@pytest.mark.parametrize(
    "path,body",
    [
        ("/run_code", {"code": "import time; time.sleep(30)", "run_timeout": 30}),
        ("/run_code", {"code": "int main(){for(;;);}", "language": "c", "run_timeout": 30}),
        (  # more cases than slots: the running ones are killed, the queued ones never start
            "/v1/run_tests",
            {"code": "import time; time.sleep(30)", "timeout": 30, "cases": [{}] * 6},
        ),
    ],
)
def test_a_client_that_leaves_stops_its_programs(
    api: SandboxdServer, path: str, body: dict
) -> None:
    """uvicorn does not cancel a handler whose client left: its programs ran on to their time
    limit (30 s here; a run_tests request's every case), holding the slots."""
    with httpx.Client(base_url=api.url, timeout=1.0) as quitter:
        with pytest.raises(httpx.ReadTimeout):
            quitter.post(path, json=body)
    end = time.monotonic() + 5
    while (running := api.client.get("/v1/sandbox/status").json()["admission"]["running"]) > 0:
        assert time.monotonic() < end, f"{running} programs still run for a client that left"
        time.sleep(0.05)
    assert api.run_code(code="print('next')")["run_result"]["stdout"] == "next\n"


# ---------------------------------------------------------------- capacity


def test_beyond_capacity_waits_in_a_bounded_queue_then_429_or_its_deadline(
    sandboxd_factory: Callable[..., SandboxdServer],
) -> None:
    server = sandboxd_factory(
        "--max-concurrency",
        "1",
        env={"TOOLENV_SANDBOX_QUEUE_SIZE": "1", "TOOLENV_SANDBOX_RETRY_AFTER_S": "2"},
    )
    results: dict[str, httpx.Response] = {}

    def send(name: str, body: dict, headers: dict | None = None) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            results[name] = c.post("/run_code", json=body, headers=headers or {})

    slow = {"code": "import time; time.sleep(1.5); print('done')"}
    first = threading.Thread(target=send, args=("running", slow))
    first.start()
    time.sleep(0.5)  # the first one holds the only slot
    second = threading.Thread(target=send, args=("queued", slow))
    second.start()
    time.sleep(0.3)  # the second one waits in the queue (size 1)
    send("rejected", {"code": "print(1)"})
    first.join()
    second.join()
    assert results["rejected"].status_code == 429
    assert results["rejected"].headers["Retry-After"] == "2"
    assert "queue" in results["rejected"].json()["detail"]
    assert results["running"].json()["run_result"]["stdout"] == "done\n"
    assert results["queued"].json()["run_result"]["stdout"] == "done\n"
    # a request whose deadline runs out while queued is not run late: the deadline ended it, so
    # it is answered as one (TimeLimitExceeded, marked), not as backpressure (429 + Retry-After)
    first = threading.Thread(target=send, args=("running", slow))
    first.start()
    time.sleep(0.5)
    started = time.monotonic()
    send("late", {"code": "print(1)"}, {"X-Toolenv-Deadline-Ms": "300"})
    late = results["late"]
    assert time.monotonic() - started < 1.2
    assert late.status_code == 200 and "Retry-After" not in late.headers, late.text
    assert late.headers.get("X-Toolenv-Deadline-Expired") == "1"
    assert late.json()["status"] == "Failed" and late.json()["compile_result"] is None
    assert late.json()["run_result"]["status"] == "TimeLimitExceeded"
    assert re.search(
        r"deadline ran out after 0\.[23]\d* s waiting for a slot", late.json()["message"]
    )
    first.join()
    admission = server.client.get("/v1/sandbox/status").json()["admission"]
    assert (admission["rejected_total"], admission["expired_total"]) == (1, 1)


def test_python_runs_take_a_warm_sandbox_which_is_refilled(
    sandboxd_factory: Callable[..., SandboxdServer],
) -> None:
    """With the fork server off (else python forks from the zygote: test_fork_server.py)."""
    api = sandboxd_factory(
        "--backend", "process", "--max-concurrency", "4",
        env={"TOOLENV_SANDBOX_FORK_SERVER": "false"},
    )  # fmt: skip

    def status() -> dict:
        return api.client.get("/v1/sandbox/status").json()

    def wait_full() -> dict:
        for _ in range(200):
            s = status()
            if s["warm"].get("/usr/bin/python3 main.py") == s["warm_target"]:
                return s
            time.sleep(0.05)
        raise AssertionError(f"warm pool not refilled: {status()}")

    before = wait_full()
    assert before["python_mode"] == "warm_spawn"
    res = api.run_code(code="import os; print(os.listdir('.'), os.getpid())")
    assert res["run_result"]["stdout"] == "['main.py'] 1\n"
    after = wait_full()
    assert after["warm_hits"] == before["warm_hits"] + 1
    assert set(after["warm_workdirs"]) != set(before["warm_workdirs"])  # a fresh one replaced it


def test_a_405_allows_every_method_of_its_path(api: SandboxdServer) -> None:
    """`/readyz` is a GET route and a HEAD route: its 405 said `Allow: GET` (the first's)."""
    r = api.client.delete("/readyz")
    assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD", r.headers
    assert r.json() == {"detail": "Method Not Allowed"}
