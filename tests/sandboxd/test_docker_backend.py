"""The docker backend on real containers: languages, limits, files, isolation flags, the pool."""

from __future__ import annotations

import os
import time
from pathlib import Path

import docker
import pytest
from docker_support import run

from sandboxd.docker_backend import DockerBackend
from sandboxd.docker_backend.container import AGENT_CAPABILITIES
from sandboxd.models import ExecStatus, Limits, RunSpec
from sandboxd.service import SandboxService
from sandboxd.wire import RunTestsRequest, Verdict
from toolenv_core.deadline import Deadline

pytestmark = pytest.mark.docker


@pytest.mark.parametrize(
    ("language", "code", "expected"),
    [
        ("python", "import sys\nprint(sys.stdin.read().upper())", "HELLO\n"),
        ("bash", 'read x; echo "bash:$x"', "bash:hello\n"),
        (
            "c",
            '#include <stdio.h>\nint main(){char b[16];scanf("%15s",b);printf("c:%s\\n",b);}',
            "c:hello\n",
        ),
        (
            "cpp",
            '#include <iostream>\n#include <string>\nint main(){std::string s;std::cin>>s;std::cout<<"cpp:"<<s<<"\\n";}',
            "cpp:hello\n",
        ),
    ],
)
def test_languages_with_stdin(portal, backend, language: str, code: str, expected: str) -> None:
    r = run(portal, backend, RunSpec(language=language, code=code, stdin="hello"))
    assert r.run is not None and r.run.status == ExecStatus.FINISHED, r
    assert r.run.exit_code == 0 and r.run.stdout == expected
    assert (r.compile is not None) == (language in ("c", "cpp"))
    assert r.backend == "docker" and r.sandbox_id.startswith("toolenv-sbx-")
    assert r.run.wall_time_s > 0 and r.run.cpu_time_s is not None and r.run.peak_memory_kb > 0
    # in microseconds, as on the process backend (SandboxFusion clients print them)
    assert all(round(t, 6) == t for t in (r.run.wall_time_s, r.run.cpu_time_s)), r.run
    assert r.compile is None or round(r.compile.wall_time_s, 6) == r.compile.wall_time_s


def test_compile_error_skips_the_run(portal, backend) -> None:
    r = run(portal, backend, RunSpec(language="c", code="int main( { return 0; }"))
    assert r.compile.status == ExecStatus.FINISHED and r.compile.exit_code != 0
    assert "error" in r.compile.stderr
    assert r.run is None and r.message == "compilation failed"


def test_compile_and_run_timeouts_are_separate(portal, backend) -> None:
    slow_compile = RunSpec(
        language="cpp",
        code="#include <bits/stdc++.h>\nint main(){}",
        compile_limits=Limits(wall_time_s=0.05),
    )
    r = run(portal, backend, slow_compile)
    assert r.compile.status == ExecStatus.TIME_LIMIT and r.run is None
    # the limit's words, not "compilation failed" (the code's fault), as on the process backend
    assert r.message == r.compile.message == "wall-clock limit of 0.05 s exceeded", r
    slow_run = RunSpec(
        language="c",
        code="int main(){for(;;);}",
        compile_limits=Limits(wall_time_s=20),
        run_limits=Limits(wall_time_s=0.5),
    )
    r = run(portal, backend, slow_run)
    assert r.compile.status == ExecStatus.FINISHED and r.compile.exit_code == 0
    assert r.run.status == ExecStatus.TIME_LIMIT and r.run.wall_time_s < 2.0


def test_output_cut_at_its_cap_drops_the_character_the_cut_split(portal, backend) -> None:
    """As on the process backend: 500 two-byte characters under a 1001-byte cap, no U+FFFD."""
    code = "import sys; sys.stdout.write('\u00e9' * 1000)"
    r = run(
        portal,
        backend,
        RunSpec(code=code, language="python", run_limits=Limits(max_output_bytes=1001)),
    )
    assert r.run.status == ExecStatus.OUTPUT_LIMIT and r.run.stdout_truncated, r.run
    assert r.run.stdout == "\u00e9" * 500, r.run.stdout[-3:]


def test_files_in_and_fetch_files_out(portal, backend) -> None:
    code = (
        "import os\n"
        "data = open('in/data.txt').read()\n"
        "open('out.txt', 'w').write(data * 2)\n"
        "os.symlink('/etc/shadow', 'shadow')\n"
        "os.symlink('/opt/toolenv/agent.py', 'agent')\n"
    )
    spec = RunSpec(
        language="python",
        code=code,
        files={"in/data.txt": b"ab"},
        fetch_files=["out.txt", "shadow", "agent", "missing.txt", "../etc/passwd"],
    )
    r = run(portal, backend, spec)
    assert r.run.status == ExecStatus.FINISHED and r.run.exit_code == 0, r.run.stderr
    assert r.files == {"out.txt": b"abab"}  # symlinks, missing and escaping paths are refused


def test_a_signal_death_reads_as_minus_the_signal(portal, backend) -> None:
    """return_code is -N for a death by signal N, as on the process backend and in the docs
    (the agent's 128 + N came through: 139, 137); a program's own exit(137) stays 137."""
    die = "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)"
    r = run(portal, backend, RunSpec(language="python", code=die))
    assert r.run.status == ExecStatus.FINISHED
    assert (r.run.exit_code, r.run.signal) == (-11, 11)
    r = run(portal, backend, RunSpec(language="python", code="import sys\nsys.exit(137)"))
    assert (r.run.exit_code, r.run.signal) == (137, None)
    slow = RunSpec(language="python", code="import time\ntime.sleep(30)")
    slow.run_limits.wall_time_s = 0.3
    r = run(portal, backend, slow)
    assert r.run.status == ExecStatus.TIME_LIMIT
    assert (r.run.exit_code, r.run.signal) == (-9, 9)


def test_a_limit_over_before_the_program_starts_still_kills_it(portal, backend) -> None:
    """A wall limit that ends before the agent's child has called setsid: killing the (not yet
    existing) session missed it, and the program ran on to its own end unbounded (a 0.1 ms
    limit, then a 3 s sleep that printed 'done' and exited 0, 7 times in 8)."""
    for _ in range(3):
        spec = RunSpec(language="python", code="import time\ntime.sleep(3)\nprint('done')")
        spec.run_limits.wall_time_s = 0.0001
        r = run(portal, backend, spec)
        assert r.run.status == ExecStatus.TIME_LIMIT
        assert (r.run.exit_code, r.run.signal) == (-9, 9), r.run


def test_a_spent_deadline_runs_nothing_and_keeps_the_container(portal, backend) -> None:
    """A run whose deadline is spent by the time it has a container: the job was sent anyway,
    the host stopped waiting before the agent could answer and destroyed the container (a
    run_tests request whose deadline ran out mid-way emptied the pool; so did a deadline of 0)."""
    end = time.monotonic() + 60
    while backend.status()["idle"] < 2 and time.monotonic() < end:
        time.sleep(0.05)  # the pool full again after earlier tests
    before = backend.status()
    for _ in range(3):
        spec = RunSpec(language="python", code="print(1)")
        r = portal.call(backend.run, spec, Deadline.after(0.01))
        assert r.run.status == ExecStatus.TIME_LIMIT
        assert r.run.message == "the request deadline expired before start"
    after = backend.status()
    assert (after["created"], after["recycled"]) == (before["created"], before["recycled"])


def test_a_time_limit_names_the_limit_that_ended_it(portal, backend) -> None:
    """The program's own wall limit, or the request's deadline: it said "time limit exceeded
    (wall 10.0 s or CPU time)" for a run the deadline cut after 0.35 s."""
    spec = RunSpec(language="python", code="import time\ntime.sleep(30)")
    spec.run_limits.wall_time_s = 0.4
    r = run(portal, backend, spec)
    assert r.run.message == "wall-clock limit of 0.4 s exceeded"
    spec.run_limits.wall_time_s = 10
    r = run(portal, backend, spec, deadline_s=0.6)
    assert r.run.status == ExecStatus.TIME_LIMIT
    assert r.run.message.startswith("the request deadline ended it after "), r.run.message
    assert r.run.message.endswith(" s (its own limit: 10 s)"), r.run.message


def test_a_memory_limit_names_the_one_that_ended_the_run(portal, backend) -> None:
    """A run that asked for more memory than its container has ends at the container's limit:
    it said "memory limit of 4096 MB exceeded" for a program the container's 1024 MB ended."""
    spec = RunSpec(language="python", code="a = bytearray(1500 << 20)\nprint(len(a))")
    spec.run_limits.memory_mb = 4096
    r = run(portal, backend, spec)
    assert r.run is not None and r.run.status == ExecStatus.MEMORY_LIMIT, r.run
    assert r.run.message == (
        "memory limit of 1024 MB exceeded (the container's docker_memory_mb, below the 4096 MB "
        "asked)"
    )
    spec.run_limits.memory_mb = 128
    r = run(portal, backend, spec)
    assert r.run is not None and r.run.message == "memory limit of 128 MB exceeded", r.run


def started_service(backend: DockerBackend) -> SandboxService:
    service = SandboxService(backend.settings, backend)
    service.started = True  # the module's backend, already started
    return service


def test_run_tests_compile_error_is_every_cases_verdict(portal, backend) -> None:
    """A compile error is every case's verdict, from one compile in one container: each case
    compiled in a container of its own (a compile error took up to `concurrency` containers;
    the first one stopped the others, which read "skipped" beside those already compiling)."""
    before = backend.status()
    req = RunTestsRequest(code="int main( {", language="c", cases=[{}] * 12)
    res = portal.call(started_service(backend).run_tests, req, Deadline.after(60))
    assert res.verdict == Verdict.COMPILE_ERROR and res.message == "compilation failed"
    assert [c.verdict for c in res.cases] == [Verdict.COMPILE_ERROR] * 12
    assert res.compile_result is not None and res.compile_result.return_code != 0
    after = backend.status()
    assert after["runs_total"] == before["runs_total"]  # no case ran
    assert after["compiles_total"] == before["compiles_total"] + 1


def test_run_tests_compiles_once_and_each_case_gets_a_clean_container(portal, backend) -> None:
    """A C++ program against N cases: one compile (the process backend's way), then every case
    runs the binary in a container reset after the case before (the case leaves a marker file
    in /tmp and the workdir, and a daemon: no case may see another's)."""
    code = (
        "#include <cstdio>\n#include <unistd.h>\n"
        'int main(){long a,b; if(scanf("%ld %ld",&a,&b)!=2) return 3;\n'
        ' if(access("/tmp/seen",F_OK)==0 || access("seen",F_OK)==0) {puts("dirty"); return 0;}\n'
        ' fclose(fopen("/tmp/seen","w")); fclose(fopen("seen","w"));\n'
        " if(fork()==0){setsid(); sleep(30); return 0;}\n"
        ' if(a<0) return 7;\n printf("%ld\\n",a+b);}\n'
    )
    cases = [{"stdin": f"{i} {i}", "expected_stdout": str(2 * i)} for i in range(6)]
    cases += [{"stdin": "1 1", "expected_stdout": "3"}, {"stdin": "-1 0", "expected_stdout": ""}]
    before = backend.status()
    req = RunTestsRequest(code=code, language="cpp", cases=cases, compile_timeout=30)
    res = portal.call(started_service(backend).run_tests, req, Deadline.after(120))
    verdicts = [c.verdict for c in res.cases]
    assert verdicts == [Verdict.ACCEPTED] * 6 + [Verdict.WRONG_ANSWER, Verdict.RUNTIME_ERROR], res
    assert res.compile_result is not None and res.compile_result.return_code == 0
    assert res.cases[6].run_result.stdout == "2\n"
    assert res.cases[7].run_result.return_code == 7
    after = backend.status()
    assert after["compiles_total"] == before["compiles_total"] + 1
    assert after["runs_total"] == before["runs_total"] + len(cases)


def test_run_tests_with_a_binary_over_the_artifact_cap(portal, backend) -> None:
    """A binary larger than the artifact a compile brings back (`max_output_bytes`): every case
    compiles in its own container, as before there was one compile per request."""
    code = (
        "#include <stdio.h>\nchar big[20 << 20] = {1};\n"
        'int main(){int x; if (scanf("%d", &x) != 1) return 2; printf("%d\\n", 2 * x + big[0] - 1);}\n'
    )
    cases = [{"stdin": str(i), "expected_stdout": str(2 * i)} for i in range(3)]
    before = backend.status()
    req = RunTestsRequest(code=code, language="c", cases=cases, compile_timeout=30)
    res = portal.call(started_service(backend).run_tests, req, Deadline.after(120))
    assert [c.verdict for c in res.cases] == [Verdict.ACCEPTED] * 3, res
    assert backend.status()["compiles_total"] == before["compiles_total"] + 1 + len(cases)


def test_bad_file_path_is_an_error_not_a_crash(portal, backend) -> None:
    r = run(portal, backend, RunSpec(language="python", code="print(1)", files={"../x": b"x"}))
    assert r.run is None and "leaves the workdir" in r.message
    r = run(portal, backend, RunSpec(language="python", code="print(2)"))
    assert r.run.stdout == "2\n"


def test_unknown_language(portal, backend) -> None:
    r = run(portal, backend, RunSpec(language="cobol", code="x"))
    assert r.run is None and "supported: bash, c, cpp, python" in r.message


def test_container_isolation_flags(backend) -> None:
    client = docker.from_env()
    (container,) = [c for c in backend.pool._live.values()][:1]
    attrs = client.containers.get(container.id).attrs
    host = attrs["HostConfig"]
    assert host["NetworkMode"] == "none"
    assert host["ReadonlyRootfs"] is True
    assert host["CapDrop"] == ["ALL"] and sorted(host["CapAdd"]) == sorted(AGENT_CAPABILITIES)
    assert host["SecurityOpt"] == ["no-new-privileges"]
    assert host["Memory"] == backend.settings.docker_memory_mb << 20
    assert host["MemorySwap"] == host["Memory"]
    assert host["PidsLimit"] == backend.settings.docker_pids_limit
    assert host["NanoCpus"] == int(backend.settings.docker_cpus * 1e9)
    assert host["CpuShares"] == 512  # one run per container: the run's CPU weight
    assert set(host["Tmpfs"]) == {"/sandbox", "/tmp", "/dev/shm"}
    assert all("nr_inodes=16384" in opts for opts in host["Tmpfs"].values())
    assert host["IpcMode"] == "private"
    assert host["Sysctls"] == {"net.ipv4.tcp_max_tw_buckets": "0"}
    labels = attrs["Config"]["Labels"]
    assert labels["toolenv.sandbox"] == "1" and labels["toolenv.pool"] == backend.pool.pool_id
    sock_dir = Path(container.socket_dir)
    st = sock_dir.stat()
    assert (st.st_mode & 0o777, st.st_uid) == (0o700, os.geteuid())


def test_status_reports_the_pool(backend) -> None:
    s = backend.status()
    assert s["backend"] == "docker" and s["pool_size"] == 2
    assert s["live"] == 2 and s["idle"] + s["busy"] == 2 and s["refilling"] == 0
