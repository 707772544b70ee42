"""The sandboxd API's refusals on a real server: languages, fields, bad JSON, big bodies."""

from __future__ import annotations

import pytest
from sbx_support import SandboxdServer, post

pytestmark = pytest.mark.bwrap


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
