"""The sandboxd HTTP API on a real server (process backend, real bwrap, loopback HTTP)."""

from __future__ import annotations

import base64
import re
import threading
import time
from collections.abc import Callable

import httpx
import pytest
from sbx_support import SandboxdServer

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


@pytest.fixture(scope="module")
def api(sandboxd_factory: Callable[..., SandboxdServer]) -> SandboxdServer:
    return sandboxd_factory(
        "--max-concurrency", "4", env={"TOOLENV_SANDBOX_MAX_BODY_BYTES": "65536"}
    )


def post(server: SandboxdServer, body: object, path: str = "/run_code", **kw) -> httpx.Response:
    return server.client.post(path, json=body, **kw)


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
    """Output past the cap is OutputLimitExceeded either way; a program that had exited by itself
    before the service read that output was not killed (it said "the program was killed" beside
    a return_code of 0: which one comes first is a race, so a few runs see both)."""
    slow = "import sys, time; sys.stdout.write('x' * 5000); time.sleep(5)"
    quick = "import sys; sys.stdout.write('x' * 5000)"
    for code in [slow] + [quick] * 5:
        rr = api.run_code(code=code, max_output_bytes=1000)["run_result"]
        assert rr["status"] == "OutputLimitExceeded" and rr["stdout_truncated"], rr
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


def test_limits_and_accounting_are_reported(api: SandboxdServer) -> None:
    res = api.run_code(
        code="a = bytearray(300 * 2**20)\nprint(len(a))", memory_limit_MB=128, run_timeout=10
    )
    assert res["run_result"]["status"] == "MemoryLimitExceeded", res
    res = api.run_code(code="a = bytearray(40 * 2**20)\nprint(len(a))", memory_limit_MB=256)
    assert res["status"] == "Success"
    assert 40 * 1024 <= res["run_result"]["peak_memory_kb"] < 256 * 1024
    res = api.run_code(
        code="import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    )
    assert res["run_result"]["cpu_time"] >= 0.25


SPIN_C = r"""#include <stdio.h>
#include <time.h>
int main(void) {
  volatile long n = 0;
  while (clock() < CLOCKS_PER_SEC * 3 / 10) n++;
  printf("%d\n", n > 0);
  return 0;
}
"""


def test_cpu_time_of_c_and_bash_is_their_cgroups(api: SandboxdServer) -> None:
    """A C program that spins 0.3 s of CPU reported `cpu_time` 0.002 (bwrap's own: bwrap exits
    on its init's word without reaping it, so the program's CPU time never reaches the service's
    wait4), then null. It is the run's cgroup's now, for bash too. A compiler is its namespace's
    init, so its CPU time is still wait4's."""
    res = api.run_code(code=SPIN_C, language="c", compile_timeout=30)
    assert res["status"] == "Success", res
    run = res["run_result"]
    assert 0.28 <= run["cpu_time"] <= run["execution_time"] + 0.05, res
    assert res["compile_result"]["cpu_time"] >= 0.01, res  # cc1 and as: 0.04 s here
    # bash's `times`: its own user and system time (it starts no child)
    code = "i=0; while [ $i -lt 30000 ]; do i=$((i+1)); done; times"
    res = api.run_code(code=code, language="bash")
    assert res["status"] == "Success", res
    user, system = (float(t[:-1].split("m")[1]) for t in res["run_result"]["stdout"].split()[:2])
    run = res["run_result"]
    assert 0.5 * (user + system) <= run["cpu_time"] <= run["execution_time"] + 0.05, res
    assert user + system >= 0.02, res  # (a loop long enough to tell)


CPU_RLIMIT_C = r"""#include <stdio.h>
#include <sys/resource.h>
#include <unistd.h>
int main(void) {
  struct rlimit r;
  getrlimit(RLIMIT_CPU, &r);
  printf("%ld %ld\n", (long)r.rlim_cur, (long)r.rlim_max);
  fflush(stdout);
  /* Threads on two cores reach the 6 s limit after 3 s of wall time or more: so much time
     passes, then the soft limit is brought within 1 s of CPU time, to reach it for sure. */
  sleep(3);
  r.rlim_cur = 1;
  setrlimit(RLIMIT_CPU, &r);
  for (volatile long n = 0;; n++) {}
}
"""


def test_a_cpu_time_limit_is_a_time_limit_on_every_language(api: SandboxdServer) -> None:
    """The CPU rlimit was soft = hard: the kernel's SIGKILL, told from any other by the CPU
    time, which a C program's step does not have (above): a C++ solution whose threads reached
    the CPU limit before the wall clock's was `Finished`, "killed by signal 9", a runtime error.
    Now SIGXCPU comes first (soft), SIGKILL one second later (hard), as on Docker; an exit code
    that reads as SIGXCPU (bwrap reports 152 for both) is not the limit's unless the program ran
    long enough to spend its CPU time on this host's cores."""
    res = api.run_code(code=CPU_RLIMIT_C, language="c", run_timeout=5, compile_timeout=30)
    run = res["run_result"]
    assert run["stdout"] == "6 7\n", res  # ceil(5 s) + 1, and the hard limit 1 s above
    assert run["status"] == "TimeLimitExceeded" and run["signal"] == 24, res
    assert res["message"] == "CPU-time limit of 6 s exceeded"
    code = "import resource\nprint(*resource.getrlimit(resource.RLIMIT_CPU))"
    assert api.run_code(code=code, run_timeout=5)["run_result"]["stdout"] == "6 7\n"
    res = api.run_code(code="int main(void){ return 152; }", language="c", run_timeout=5)
    assert res["run_result"]["status"] == "Finished", res


HARD_CPU_LIMIT_C = r"""#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
static void *spin(void *arg) { for (volatile long n = 0;; n++) {} return arg; }
int main(void) {
  /* A program that ignores SIGXCPU meets the hard limit: SIGKILL. Brought down to 1 s of CPU
     (two threads: about 0.5 s of wall time) so that it comes well before the 1 s timeout. */
  struct rlimit r = {1, 1};
  signal(SIGXCPU, SIG_IGN);
  setrlimit(RLIMIT_CPU, &r);
  pthread_t t;
  pthread_create(&t, 0, spin, 0);
  spin(0);
}
"""


def test_the_hard_cpu_limits_sigkill_is_a_time_limit_for_c(api: SandboxdServer) -> None:
    """The hard CPU limit's SIGKILL is told from any other SIGKILL by the step's CPU time: a C
    program had none (bwrap's init reaps it), so a program that ignored SIGXCPU and spun into
    its hard limit was `Finished`, signal 9, no message: a runtime error, not the limit."""
    res = api.run_code(code=HARD_CPU_LIMIT_C, language="c", run_timeout=1, compile_timeout=30)
    run = res["run_result"]
    assert run["signal"] == 9 and run["cpu_time"] >= 0.9, res
    assert run["status"] == "TimeLimitExceeded", res
    assert run["message"] == "CPU-time limit of 2 s exceeded", res  # ceil(1 s) + 1


TOUCH_MB_C = r"""#include <stdio.h>
#include <stdlib.h>
int main(void) {
  size_t mb;
  if (scanf("%zu", &mb) != 1) return 2;
  volatile char *p = malloc(mb << 20);  /* volatile: -O2 may not drop the pages it touches */
  for (size_t i = 0; i < (mb << 20); i += 4096) p[i] = 1;
  printf("%zu\n", mb);
  return 0;
}
"""


def test_peak_memory_of_a_compiled_program_is_its_own(api: SandboxdServer) -> None:
    """A compiled run shares its cgroup slot with its compile step: the peak was measured above
    the whole usage counter at the end of the compile, which still held the kernel's per-CPU
    precharge and kernel memory freed a few ms later, so a small program reported 0 and one
    touching 8 MB about 7.8 MB. `/usr/bin/time -v` reports about 1.3 MB and 9.5 MB for them
    (shared library pages, charged to whoever read them first, are not the run's own)."""
    for _ in range(4):
        res = api.run_code(code=TOUCH_MB_C, language="c", stdin="0", compile_timeout=30)
        assert res["status"] == "Success", res
        assert 0 < res["run_result"]["peak_memory_kb"] < 4096, res["run_result"]
    for _ in range(3):
        res = api.run_code(code=TOUCH_MB_C, language="c", stdin="8", compile_timeout=30)
        assert res["status"] == "Success", res
        assert 8 * 1024 <= res["run_result"]["peak_memory_kb"] < 12 * 1024, res["run_result"]


# ---------------------------------------------------------------- bad requests


def test_unknown_language_is_400_listing_the_supported_ones(api: SandboxdServer) -> None:
    r = post(api, {"code": "x", "language": "cobol"})
    assert r.status_code == 400
    assert "cobol" in r.json()["detail"] and "python" in r.json()["detail"]


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"language": "python"}, "code"),
        ({"code": "print(1)", "run_timeout": 0}, "run_timeout"),
        ({"code": "print(1)", "run_timeout": 10_000}, "run_timeout"),
        ({"code": "print(1)", "compile_timeout": -1}, "compile_timeout"),
        ({"code": "print(1)", "memory_limit_MB": 10**9}, "memory_limit_MB"),
        ({"code": "print(1)", "memory_limit_MB": -5}, "-1 or 0 (the default, 512)"),
        ({"code": "print(1)", "max_output_bytes": 10**12}, "max_output_bytes"),
        ({"code": "print(1)", "cpu_limit": 1000}, "cpu_limit"),
        ({"code": "print(1)", "cpu_limit": 0.005}, "cpu_limit must be >= 0.01"),  # was EINVAL
        ({"code": "print(1)", "files": {"a": "not base64!"}}, "base64"),
        ({"code": "print(1)", "files": {"../escape": ""}}, "escape"),
        ({"code": "print(1)", "files": {"a": "", "a/b": ""}}, "cannot be both a file and a dir"),
        ({"code": "print(1)", "files": {"a": "", "./a": ""}}, "name the same file"),
        ({"code": "print(1)", "fetch_files": ["/etc/passwd"]}, "/etc/passwd"),
        # where the program's source or binary goes: silently replaced, or a failed compile
        (
            {"code": "print(1)", "files": {"main.py": "eA=="}},
            "files 'main.py': 'main.py' is the python program's source file",
        ),
        (
            {"code": "int main(){}", "language": "c", "files": {"main/data.txt": "eA=="}},
            "files 'main/data.txt': 'main' is the c program's binary",
        ),
        ({"code": "echo", "language": "bash", "files": {"./main.sh": "eA=="}}, "'main.sh' is"),
        # what is wrong with the name (it said "must be relative ..., without '..'")
        ({"code": "print(1)", "files": {"": "eA=="}}, "'' names no file: it is empty, blank"),
        ({"code": "print(1)", "files": {"\n": "eA=="}}, "names no file"),
        ({"code": "print(1)", "fetch_files": ["."]}, "'.' names no file"),
        ({"code": "print(1)", "files": {"a\0b": "eA=="}}, "has a NUL byte"),
        # names the file system cannot hold (an ENAMETOOLONG SandboxError with the host's path)
        ({"code": "print(1)", "files": {"a" * 256: ""}}, "at most 1024 bytes, 255 per name"),
        ({"code": "print(1)", "files": {"ab/" * 400 + "x": ""}}, "is too long"),
        ({"code": "print(1)", "fetch_files": ["a" * 256]}, "is too long"),
        # each path is handled on the event loop: 100,000 of them stalled every request 5 s
        (
            {"code": "print(1)", "files": {f"{i}": "" for i in range(1001)}},
            "at most 1000 files per request, got 1001",
        ),
        (
            {"code": "print(1)", "fetch_files": [f"{i}" for i in range(1001)]},
            "at most 1000 fetch_files per request, got 1001",
        ),
    ],
)
def test_invalid_fields_are_422(api: SandboxdServer, body: dict, needle: str) -> None:
    r = post(api, body)
    assert r.status_code == 422, r.text
    assert needle in r.text


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/run_code", b'{"code": "print(1)", "memory_limit_MB": NaN}', "memory_limit_MB"),
        ("/run_code", b'{"code": "print(1)", "max_output_bytes": Infinity}', "max_output_bytes"),
        (
            "/v1/run_tests",
            b'{"code": "print(1)", "cases": [{}], "concurrency": NaN}',
            "concurrency",
        ),
    ],
)
def test_non_finite_numbers_are_422_naming_the_field(
    api: SandboxdServer, path: str, body: bytes, field: str
) -> None:
    # Python's JSON reader takes NaN and Infinity; the 422 must not try to echo them back
    r = api.client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == [field]


@pytest.mark.parametrize(
    "path,body,loc",
    [
        ("/run_code", rb'{"code": "print(1)  # \ud800"}', ["code"]),
        ("/run_code", rb'{"code": "print(1)", "stdin": "\udfff"}', ["stdin"]),
        ("/run_code", rb'{"code": "print(1)", "files": {"\ud800": ""}}', None),
        ("/run_code", rb'{"code": "print(1)", "fetch_files": ["\ud800"]}', None),
        ("/v1/run_tests", rb'{"code": "print(1)  # \ud800", "cases": [{}]}', ["code"]),
        (
            "/v1/run_tests",
            rb'{"code": "print(1)", "cases": [{"stdin": "\ud800"}]}',
            ["cases", 0, "stdin"],
        ),
    ],
)
def test_a_lone_surrogate_is_422(
    api: SandboxdServer, path: str, body: bytes, loc: list | None
) -> None:
    """JSON may escape half a surrogate pair; no file or pipe can hold it (a SandboxError,
    UnicodeEncodeError, before; in a run_tests case a sandbox_error with no message)."""
    r = api.client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert "lone surrogate" in r.text
    if loc is not None:
        assert r.json()["detail"][0]["loc"] == loc
    pair = rb'{"code": "print(input())", "stdin": "\ud83d\ude00"}'  # a whole pair still runs
    r = api.client.post("/run_code", content=pair, headers={"content-type": "application/json"})
    assert r.json()["run_result"]["stdout"] == "\U0001f600\n"


BOOL_NOT_NUMBER = "must be a number, not true (a JSON boolean is not read as 0 or 1)"


@pytest.mark.parametrize(
    "path,body,loc",
    [
        ("/run_code", {"run_timeout": True}, ["run_timeout"]),
        ("/run_code", {"compile_timeout": True}, ["compile_timeout"]),
        ("/run_code", {"memory_limit_MB": True}, ["memory_limit_MB"]),
        ("/run_code", {"cpu_limit": True}, ["cpu_limit"]),
        ("/run_code", {"max_output_bytes": True}, ["max_output_bytes"]),
        ("/v1/run_tests", {"cases": [{}], "timeout": True}, ["timeout"]),
        ("/v1/run_tests", {"cases": [{"timeout": True}]}, ["cases", 0, "timeout"]),
        ("/v1/run_tests", {"cases": [{}], "concurrency": True}, ["concurrency"]),
        ("/v1/run_tests", {"cases": [{}], "memory_limit_MB": True}, ["memory_limit_MB"]),
    ],
)
def test_a_boolean_for_a_number_is_422_naming_the_field(
    api: SandboxdServer, path: str, body: dict, loc: list
) -> None:
    """Before: pydantic read `true` as 1 (`run_timeout: true` was a 1-second run)."""
    r = post(api, {"code": "print(1)", **body}, path)
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == [{"type": "bool_not_number", "loc": loc, "msg": BOOL_NOT_NUMBER}]


def test_the_smallest_cpu_limit_runs(api: SandboxdServer) -> None:
    """0.01 cores is the kernel's smallest CFS quota (1 ms per 100 ms period)."""
    assert api.run_code(code="print(1)", cpu_limit=0.01)["status"] == "Success"


def test_sandboxfusion_numbers_still_read_as_before(api: SandboxdServer) -> None:
    """ints, floats (and numeric strings, as SandboxFusion's lax pydantic reads them) all run."""
    for fields in (
        {"run_timeout": 5, "compile_timeout": 10, "memory_limit_MB": 256},
        {"run_timeout": 2.5, "compile_timeout": 7.5, "memory_limit_MB": -1},
        {"run_timeout": "5", "memory_limit_MB": "256"},
    ):
        r = post(api, {"code": "print(1)", "language": "python", **fields})
        assert r.status_code == 200 and r.json()["status"] == "Success", (fields, r.text)


def test_malformed_json_is_400_and_big_body_413(api: SandboxdServer) -> None:
    for bad in (b"{not json", b"[" * 30_000 + b"]" * 30_000):  # too deep: a 500 before
        r = api.client.post("/run_code", content=bad, headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert r.json() == {"detail": "request body is not valid JSON"}
    r = post(api, {"code": "#" * 70_000})
    assert r.status_code == 413
    assert r.json() == {"detail": "request body exceeds the limit of 65536 bytes"}


def test_bad_deadline_header_is_400(api: SandboxdServer) -> None:
    r = post(api, {"code": "print(1)"}, headers={"X-Toolenv-Deadline-Ms": "soon"})
    assert r.status_code == 400 and "X-Toolenv-Deadline-Ms" in r.text


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


def test_a_time_limit_names_the_limit_that_ended_it(api: SandboxdServer) -> None:
    """The program's own run_timeout, or the request's deadline, in the Docker backend's words:
    a run_timeout of 30 s that a 600 ms deadline cut said "wall-clock limit of 0.6 s exceeded",
    a limit the caller never set."""
    sleep = {"code": "import time; time.sleep(30)", "language": "python"}
    res = api.run_code(**sleep, run_timeout=0.4)
    assert res["message"] == res["run_result"]["message"] == "wall-clock limit of 0.4 s exceeded"
    for language, code in (("python", sleep["code"]), ("bash", "sleep 30")):
        r = post(
            api,
            {"code": code, "language": language, "run_timeout": 30},
            headers={"X-Toolenv-Deadline-Ms": "600"},
        )
        run = r.json()["run_result"]
        assert run["status"] == "TimeLimitExceeded", r.json()
        assert run["message"].startswith("the request deadline ended it after "), run
        assert run["message"].endswith(" s (its own limit: 30 s)"), run


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
