"""`toolenv traces fetch`: download the published PolyTrace files from a real HTTP server on
127.0.0.1 (or a directory), verify size and sha256, write atomically into the cache; the other
commands find cached traces by name."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import Result
from testkit import ServerProcess, free_port
from typer.testing import CliRunner

from toolenv.cli import build_app
from toolenv_core.polytrace.cache import default_cache_dir, trace_cache_dir
from toolenv_core.polytrace.fetch import Fetcher
from toolenv_core.polytrace.manifest import load_manifest

app = build_app()
REPO_ROOT = Path(__file__).resolve().parents[2]

# Small files for most tests; one search_r1 step (3.4 MB) where a real trace is needed.
SMALL = ["rllm_deepcoder/reward_timings_step_*", "intern_s1"]
STEP0 = "search_r1/multiturn_workload_step_0.jsonl"


def serve_dir(root: Path) -> ServerProcess:
    """Python's own http.server, a real server on loopback, serving `root`."""
    port = free_port()
    argv = [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]
    argv += ["--directory", str(root)]
    return ServerProcess(argv, f"http://127.0.0.1:{port}").start("/", timeout=30)


@pytest.fixture(scope="module")
def mirror(polytrace_dir: Path) -> Iterator[str]:
    server = serve_dir(polytrace_dir)
    yield server.url
    server.stop()


def traces(*args: str, cache: Path | None = None) -> Result:
    """`toolenv traces ...` in-process (the HTTP server it talks to is a real process)."""
    env = {"COLUMNS": "200", "TOOLENV_TRACES_CACHE_DIR": str(cache) if cache else None}
    return CliRunner().invoke(app, ["traces", *args], env=env)


def toolenv(*args: str, cache: Path) -> Result:
    return CliRunner().invoke(app, list(args), env={"TOOLENV_TRACES_CACHE_DIR": str(cache)})


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".part")]


def test_shipped_manifest_is_the_upstream_list(polytrace_dir: Path) -> None:
    """The manifest inside the package carries every row of UPSTREAM.tsv and its pinned commit."""
    text = (polytrace_dir / "UPSTREAM.tsv").read_text()
    rows = [line.split("\t") for line in text.splitlines() if line and not line.startswith("#")]
    manifest = load_manifest()
    assert [(e.name, e.upstream, str(e.bytes), e.sha256) for e in manifest.files] == [
        tuple(r) for r in rows[1:]
    ]
    assert manifest.commit in text and manifest.base_url.endswith(f"/{manifest.commit}/")
    for entry in manifest.files:  # the local copies verify against it too
        local = polytrace_dir / entry.name
        if local.exists():
            assert local.stat().st_size == entry.bytes and sha256(local) == entry.sha256


def test_fetch_over_http_verifies_caches_and_is_found_by_name(mirror: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    done = traces("fetch", *SMALL, STEP0, "--from", mirror, "--json", cache=cache)
    assert done.exit_code == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["cache_dir"] == str(cache) and report["failed"] == 0
    assert report["fetched"] == len(report["files"]) == 7
    for f in report["files"]:
        entry = next(e for e in load_manifest().files if e.name == f["name"])
        path = cache / entry.name
        assert path.stat().st_size == entry.bytes and sha256(path) == entry.sha256
        assert path.stat().st_mode & 0o777 == 0o644  # readable by whoever shares the cache
        assert f["source"] == f"{mirror}/{entry.name}"
    assert leftovers(cache) == []
    # A second run verifies what is there and downloads nothing.
    again = json.loads(
        traces("fetch", *SMALL, STEP0, "--from", mirror, "--json", cache=cache).stdout
    )
    assert again["cached"] == 7 and again["fetched"] == 0
    # Human output: one summary line; `list` marks the cached files.
    human = traces("fetch", "intern_s1", "--from", mirror, cache=cache)
    assert human.exit_code == 0 and "0 fetched, 1 already cached, 0 failed" in human.stdout
    listed = json.loads(traces("list", "--json", cache=cache).stdout)
    assert {f["name"] for f in listed["files"] if f["cached"]} == {
        f["name"] for f in report["files"]
    }
    # Other commands resolve a bare file name and a directory name against the cache.
    fit = toolenv("emulators", "fit", "multiturn_workload_step_0.jsonl", "--json", cache=cache)
    assert fit.exit_code == 0, fit.stderr
    fitted = json.loads(fit.stdout)
    assert fitted["n"] == 3456  # step 0's successful search calls
    assert fitted["statuses"]["left_out"] == {"unknown": 13}  # of its 3,469
    reward = toolenv(
        "emulators", "fit", "rllm_deepcoder", "--tool", "reward", "--json", cache=cache
    )
    assert reward.exit_code == 0 and json.loads(reward.stdout)["n"] == 10  # 2 batches per step


def test_fetch_from_directories_in_either_layout(polytrace_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    done = traces("fetch", *SMALL, "--from", str(polytrace_dir), "--json", cache=cache)
    assert done.exit_code == 0, done.stderr
    assert json.loads(done.stdout)["fetched"] == 6
    # A clone of the upstream repository: files under their upstream paths.
    clone = tmp_path / "PolyTrace"
    for entry in load_manifest().select(["rllm_deepcoder/reward_timings_step_*"]):
        (clone / entry.upstream).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(polytrace_dir / entry.name, clone / entry.upstream)
    other = tmp_path / "other"
    done = traces("fetch", "rllm_deepcoder/reward_*", "--from", str(clone), "--json", cache=other)
    assert done.exit_code == 0, done.stderr
    files = json.loads(done.stdout)["files"]
    assert len(files) == 5 and all(f["source"].startswith(str(clone / "rllm")) for f in files)


def test_corrupted_mirror_is_refused_and_the_good_cache_stays(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    assert traces("fetch", *SMALL, "--from", str(polytrace_dir), cache=cache).exit_code == 0
    good = {p: p.read_bytes() for p in cache.rglob("*.json*")}
    # A mirror with one byte flipped in one file, one file cut short, one with bytes added.
    bad = tmp_path / "bad"
    shutil.copytree(polytrace_dir / "rllm_deepcoder", bad / "rllm_deepcoder")
    shutil.copytree(polytrace_dir / "intern_s1", bad / "intern_s1")
    flipped = bad / "rllm_deepcoder" / "reward_timings_step_0.jsonl"
    data = bytearray(flipped.read_bytes())
    data[10] ^= 0x01
    flipped.write_bytes(bytes(data))
    short = bad / "rllm_deepcoder" / "reward_timings_step_1.jsonl"
    short.write_bytes(short.read_bytes()[:-7])
    longer = bad / "intern_s1" / "enhanced_task_distribution_parameters.json"
    longer.write_bytes(longer.read_bytes() + b"\n" * 100)
    server = serve_dir(bad)
    try:
        done = traces("fetch", *SMALL, "--from", server.url, "--force", "--json", cache=cache)
    finally:
        server.stop()
    assert done.exit_code == 1
    report = json.loads(done.stdout)
    assert report["failed"] == 3 and report["fetched"] == 3  # the intact files still land
    errors = {f["name"]: f["error"] for f in report["files"] if f["status"] == "failed"}
    step0 = errors["rllm_deepcoder/reward_timings_step_0.jsonl"]
    assert step0.startswith("rllm_deepcoder/reward_timings_step_0.jsonl: sha256 mismatch")
    assert load_manifest().select(["reward_timings_step_0.jsonl"])[0].sha256 in step0
    assert (
        "size mismatch: expected 401 bytes, got 394 (from http://"
        in errors["rllm_deepcoder/reward_timings_step_1.jsonl"]
    )
    assert (  # each mismatch names its source (this one did not)
        f"size mismatch: more than the expected 173273 bytes (from {server.url}/"
        in errors["intern_s1/enhanced_task_distribution_parameters.json"]
    )
    assert "sha256 mismatch" in done.stderr  # each failure also on stderr, one line each
    # Nothing half-written, and the verified copies are byte for byte what they were.
    assert leftovers(cache) == []
    assert {p: p.read_bytes() for p in cache.rglob("*.json*")} == good
    # Into an empty cache, a bad file leaves no file at all.
    empty = tmp_path / "empty"
    done = traces("fetch", "reward_timings_step_0.jsonl", "--from", str(bad), cache=empty)
    assert done.exit_code == 1 and "sha256 mismatch" in done.stderr
    assert [p for p in empty.rglob("*") if p.is_file()] == []


def test_interrupted_download_leaves_nothing(polytrace_dir: Path, tmp_path: Path) -> None:
    manifest = load_manifest()
    [entry] = manifest.select([STEP0])

    def interrupt(_entry, _n: int) -> None:
        raise KeyboardInterrupt

    fetcher = Fetcher(manifest, tmp_path, polytrace_dir, progress=interrupt)
    with pytest.raises(KeyboardInterrupt):
        fetcher.fetch(entry)
    fetcher.close()
    assert list(tmp_path.rglob("*")) == []  # not even the empty search_r1/ it made


def test_fetch_bad_input_is_a_clear_error(mirror: str, tmp_path: Path) -> None:
    done = traces("fetch", "no_such_workload", "--dest", str(tmp_path))
    assert done.exit_code == 2 and "matches no published PolyTrace file" in done.stderr
    assert "search_r1" in done.stderr  # says which names exist
    done = traces(
        "fetch", "intern_s1", "--from", str(tmp_path / "nowhere"), "--dest", str(tmp_path)
    )
    assert done.exit_code == 2 and "not a URL" in done.stderr
    # A file the mirror does not hold: named, with the URL and the status.
    done = traces(
        "fetch",
        "search_r1/multiturn_workload_step_5.jsonl",
        "--from",
        mirror,
        "--dest",
        str(tmp_path),
    )
    assert done.exit_code == 1 and "Traceback" not in done.stderr
    step5 = "search_r1/multiturn_workload_step_5.jsonl"
    [entry] = load_manifest().select([step5])
    assert (  # either layout: a mirror laid out like the cache was told of the upstream's alone
        f"error: {step5}: HTTP 404 from {mirror}/{step5} and from {mirror}/{entry.upstream}\n"
    ) in done.stderr
    # An unreachable server (a closed port on loopback): said once, the other files not tried.
    dead = f"http://127.0.0.1:{free_port()}"
    done = traces("fetch", *SMALL, "--from", dead, "--dest", str(tmp_path), "--json")
    assert done.exit_code == 1 and "Traceback" not in done.stderr
    report = json.loads(done.stdout)
    assert report["failed"] == 1 and len(report["not_tried"]) == 5
    [error] = [f["error"] for f in report["files"]]
    assert "cannot download" in error and dead in error
    assert "5 more file(s) not tried: the source does not answer" in done.stderr
    # no empty search_r1/ or rllm_deepcoder/ left behind: found by name, it was read as a trace
    # directory holding nothing, instead of "not in the trace cache: toolenv traces fetch"
    assert list(tmp_path.iterdir()) == []


def test_missing_trace_points_at_the_cache_and_fetch(tmp_path: Path) -> None:
    done = toolenv("emulators", "fit", "multiturn_workload_step_9.jsonl", cache=tmp_path)
    assert done.exit_code == 2
    assert str(tmp_path) in done.stderr and "toolenv traces fetch" in done.stderr


@pytest.mark.parametrize(
    ("source", "said"),
    [
        ("http://[::1", "not a valid URL (Invalid port: ':1')"),  # was httpx's traceback
        ("http://", "a URL without a host"),  # was six failed downloads, exit 1
        ("https:///search_r1", "a URL without a host"),
    ],
)
def test_fetch_from_a_url_that_does_not_parse_is_bad_input(
    source: str, said: str, tmp_path: Path
) -> None:
    done = traces("fetch", *SMALL, "--from", source, "--dest", str(tmp_path))
    assert done.exit_code == 2, (done.output, done.exception)
    assert done.stderr == f"error: --from {source}: {said}\n"


def test_fetch_into_a_cache_it_cannot_write_is_one_line_per_cause(
    polytrace_dir: Path, tmp_path: Path
) -> None:
    """Each was an OSError traceback from inside the fetch."""
    source = ["--from", str(polytrace_dir)]
    # nothing can be written there at all (as root, only /proc refuses): bad input, exit 2
    done = traces("fetch", *SMALL, *source, "--dest", "/proc")
    assert done.exit_code == 2, (done.output, done.exception)
    assert done.stderr.startswith("error: the trace cache /proc: cannot write in /proc: ")
    assert done.stderr.count("\n") == 1
    # a file where the cache wants a directory: that file fails, named, the others are fetched
    (tmp_path / "intern_s1").write_text("not a directory")
    done = traces("fetch", *SMALL, *source, "--dest", str(tmp_path), "--json")
    assert done.exit_code == 1, (done.output, done.exception)
    report = json.loads(done.stdout)
    assert (report["fetched"], report["failed"]) == (5, 1)
    name = "intern_s1/enhanced_task_distribution_parameters.json"
    [said] = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert said.startswith(f"error: {name}: cannot write {tmp_path / name}: ")
    assert "File exists" in said and leftovers(tmp_path) == []


def test_an_empty_cache_dir_variable_is_no_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`TOOLENV_TRACES_CACHE_DIR=` (compose's `${VAR}` with VAR unset) was Path("") = ".": the
    cache became whatever directory the command ran in. Empty now means the default."""
    monkeypatch.setenv("TOOLENV_TRACES_CACHE_DIR", "")
    monkeypatch.chdir(tmp_path)
    assert trace_cache_dir() == default_cache_dir()
    listed = json.loads(traces("list", "intern_s1", "--json").stdout)
    assert listed["cache_dir"] == str(default_cache_dir())


# Sends the first half of any file under the directory it is given, then holds the connection.
STALLING_SERVER = """
import http.server, pathlib, sys, time
root = pathlib.Path(sys.argv[2])
class Stall(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        path = root / self.path.lstrip("/")
        if not path.is_file():
            self.send_response(200 if self.path == "/" else 404)
            self.end_headers()
            return
        data = path.read_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[: len(data) // 2])
        self.wfile.flush()
        time.sleep(120)
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Stall).serve_forever()
"""


def test_a_fetch_ended_by_sigterm_leaves_no_part_file(polytrace_dir: Path, tmp_path: Path) -> None:
    """SIGTERM (`timeout`, a CI cancel) killed the fetch where it stood: its `.part` file stayed
    in the cache (Ctrl-C removed it). It unwinds as Ctrl-C does, and SIGTERM still ends it."""
    port = free_port()
    argv = [sys.executable, "-c", STALLING_SERVER, str(port), str(polytrace_dir)]
    server = ServerProcess(argv, f"http://127.0.0.1:{port}").start("/", timeout=30)
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "toolenv", "traces", "fetch", "intern_s1", "--from", server.url]
    env = {**os.environ, "TOOLENV_TRACES_CACHE_DIR": str(cache)}
    fetch = subprocess.Popen(
        cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        while not leftovers(cache) and time.monotonic() < deadline and fetch.poll() is None:
            time.sleep(0.05)
        assert leftovers(cache), "the download never started"
        fetch.send_signal(signal.SIGTERM)
        _, err = fetch.communicate(timeout=30)
    finally:
        fetch.kill()
        server.stop()
    assert fetch.returncode == -signal.SIGTERM, err
    assert [p for p in cache.rglob("*") if p.is_file()] == []  # nor any empty intern_s1/
    assert list(cache.iterdir()) == []


def test_a_cache_path_that_is_a_file_is_bad_input(polytrace_dir: Path, tmp_path: Path) -> None:
    """`traces list --dest FILE` showed every file as not cached (exit 0), `fetch` said
    "cannot write to the cache directory FILE: [Errno 17] File exists", a cache under a file
    "[Errno 20] Not a directory"; the commands that read traces said only "not in the cache"."""
    file = tmp_path / "cache.txt"
    file.write_text("not a directory")
    said = f"error: the trace cache {file} is a file, not a directory"
    for command in (["list", "intern_s1"], ["fetch", "intern_s1", "--from", str(polytrace_dir)]):
        done = traces(*command, "--dest", str(file))
        assert done.exit_code == 2, (done.output, done.exception)
        assert done.stderr == f"{said} (--dest or TOOLENV_TRACES_CACHE_DIR)\n"
        below = traces(*command, cache=file / "polytrace")
        assert below.exit_code == 2, (below.output, below.exception)
        assert below.stderr.startswith(
            f"error: the trace cache {file / 'polytrace'} is under {file}, a file "
        )
    assert file.read_text() == "not a directory"
    done = toolenv("emulators", "fit", "search_r1", cache=file)
    assert done.exit_code == 2
    assert f"nor in the trace cache {file}, which is a file, not a directory;" in done.stderr


# Answers `/` (the readiness probe), then holds every other request without a byte of answer.
HANGING_SERVER = """
import http.server, sys, time
class Hang(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/":
            self.send_response(200)
            self.end_headers()
            return
        time.sleep(120)
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Hang).serve_forever()
"""


def test_a_mirror_that_hangs_is_given_up_on_after_the_timeout(tmp_path: Path) -> None:
    """A mirror that accepted the connection and sent nothing cost the 60 s read timeout for
    every file, each failing alike (a refused connection stopped the rest at once); the wait was
    no setting. Now `--timeout` (or TOOLENV_TRACES_TIMEOUT_S) bounds it, once: the files not yet
    fetched from that source are not tried, and the errors say why."""
    port = free_port()
    argv = [sys.executable, "-c", HANGING_SERVER, str(port)]
    server = ServerProcess(argv, f"http://127.0.0.1:{port}").start("/", timeout=30)
    try:
        done = traces("fetch", *SMALL, "--from", server.url, "--timeout", "0.5", "--json",
                      cache=tmp_path)  # fmt: skip
        by_env = CliRunner().invoke(
            app,
            ["traces", "fetch", "intern_s1", "--from", server.url, "--dest", str(tmp_path)],
            env={"TOOLENV_TRACES_TIMEOUT_S": "0.25"},
        )
    finally:
        server.stop()
    assert done.exit_code == 1, (done.output, done.exception)
    report = json.loads(done.stdout)
    assert (report["failed"], len(report["not_tried"])) == (1, 5)
    [failed] = report["files"]
    assert failed["error"] == (
        f"{failed['name']}: {server.url}/{failed['name']} sent nothing for 0.5 s "
        "(--timeout or TOOLENV_TRACES_TIMEOUT_S sets it)"
    )
    assert "error: 5 more file(s) not tried: the source sent nothing for 0.5 s\n" in done.stderr
    assert by_env.exit_code == 1 and "sent nothing for 0.25 s" in by_env.stderr
    assert list(tmp_path.iterdir()) == []  # no part file, no empty directory
    zero = traces("fetch", "intern_s1", "--timeout", "0", cache=tmp_path)
    assert zero.exit_code == 2
    assert zero.stderr == "error: --timeout 0: give a number of seconds above 0\n"
    endless = traces("fetch", "intern_s1", "--timeout", "inf", cache=tmp_path)
    assert endless.exit_code == 2  # was "invalid traces settings: timeout_s: ..."
    assert endless.stderr == "error: --timeout inf: give a number of seconds above 0\n"
