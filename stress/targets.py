"""What a stress run hits: a gateway tool, a raw URL, and built-in run_code payloads.

Also the loopback guard: a stress test is a small denial-of-service by design, so it only aims at
this machine unless the user says `--allow-remote`.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class RemoteTargetError(ValueError):
    """The target resolves off loopback and `allow_remote` was not given."""


class TargetError(ValueError):
    """The target options are inconsistent or a payload cannot be read."""


def check_loopback(host: str, *, allow_remote: bool) -> None:
    """Refuse hosts that resolve to anything but 127.0.0.0/8 or ::1 (unless allowed)."""
    if allow_remote:
        return
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise RemoteTargetError(f"cannot resolve target host {host!r}: {exc}") from exc
    addresses = {info[4][0] for info in infos}
    remote = sorted(a for a in addresses if not ipaddress.ip_address(a.split("%")[0]).is_loopback)
    if remote:
        raise RemoteTargetError(
            f"target host {host!r} resolves off loopback ({', '.join(remote)}); "
            "pass --allow-remote to load-test another machine"
        )


# The methods whose request body has a meaning (RFC 9110): a `--url` without one sends `{}`.
BODY_METHODS = ("POST", "PUT", "PATCH")


# Built-in SandboxFusion `/run_code` bodies, from harmless to hostile.
RUN_CODE_PAYLOADS: dict[str, dict[str, Any]] = {
    "trivial": {"code": "print(1)", "language": "python", "run_timeout": 5},
    "cpu": {
        "code": "s = 0\nfor i in range(2_000_000):\n    s += i * i\nprint(s)",
        "language": "python",
        "run_timeout": 10,
    },
    "memory": {
        "code": "b = bytearray(200 * 1024 * 1024)\nfor i in range(0, len(b), 4096):\n    b[i] = 1\nprint(len(b))",
        "language": "python",
        "run_timeout": 10,
        "memory_limit_MB": 512,
    },
    # Never ends on its own and floods stdout: the sandbox must kill it, at its output cap (1 MiB
    # by default: within milliseconds, `limit: "output"`), else at run_timeout.
    "hostile": {
        "code": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
        "language": "python",
        "run_timeout": 2,
    },
}
RUN_CODE_PAYLOADS["cpu-bound"] = RUN_CODE_PAYLOADS["cpu"]
RUN_CODE_PAYLOADS["memory-heavy"] = RUN_CODE_PAYLOADS["memory"]


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    body: Any
    method: str = "POST"

    def describe(self) -> str:
        return f"{self.method} {self.url}"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise TargetError(f"cannot read {path}: {exc}") from exc
    except ValueError as exc:
        raise TargetError(f"{path} is not JSON: {exc}") from exc


def _json_body(value: Any) -> Any:
    """A JSON value as the load generator sends it: a string would go as its raw text (`"q"`
    sent `q`) and null as no body at all, so those two go as their JSON text."""
    return json.dumps(value).encode() if value is None or isinstance(value, str) else value


def resolve_target(
    *,
    url: str | None = None,
    gateway: str | None = None,
    tool: str | None = None,
    body: str | None = None,
    body_file: Path | None = None,
    payload: str | None = None,
    arguments: str | None = None,
    method: str = "POST",
) -> Target:
    """Turn CLI options into one target: `--url` + body, or `--gateway` + `--tool` + arguments."""
    if bool(url) == bool(gateway or tool):
        raise TargetError("give either --url, or --gateway with --tool")
    if body is not None and body_file is not None:
        raise TargetError("give --body or --body-file, not both")
    if url:
        if payload or arguments:
            raise TargetError("--payload and --arguments go with --tool, not --url")
        if body_file is not None:
            return Target(url, _json_body(_read_json(body_file)), method)
        if body is not None:
            try:
                return Target(url, _json_body(json.loads(body)), method)
            except ValueError as exc:
                raise TargetError(f"--body is not JSON: {exc}") from exc
        # `{}` only where a body means something: a HEAD went out with a JSON `{}` beside it
        return Target(url, {} if method.upper() in BODY_METHODS else None, method)
    if not gateway or not tool:
        raise TargetError("--gateway and --tool go together")
    if method.upper() != "POST":  # it was sent as a POST all the same, without a word
        raise TargetError(f"--method {method} goes with --url: a gateway tool call is a POST")
    given = [
        option
        for option, value in (
            ("--payload", payload),
            ("--arguments", arguments),
            ("--body", body),
            ("--body-file", body_file),
        )
        if value is not None
    ]
    if len(given) > 1:  # all but one were ignored without a word
        raise TargetError(f"give one of {', '.join(given)}: each sets the tool's arguments")
    args: Any
    if tool == "run_code":  # the gateway's default tools table calls the code sandbox "sandbox"
        tool = "sandbox"
    if tool == "sandbox" and payload is not None:
        if payload not in RUN_CODE_PAYLOADS:
            known = ", ".join(sorted(RUN_CODE_PAYLOADS))
            raise TargetError(f"unknown run_code payload {payload!r}; built-in: {known}")
        args = RUN_CODE_PAYLOADS[payload]
    elif payload is not None:
        raise TargetError("--payload is for --tool run_code (or sandbox)")
    elif body_file is not None:
        args = _read_json(body_file)
    elif arguments is not None or body is not None:
        option, text = ("--arguments", arguments) if arguments is not None else ("--body", body)
        try:
            args = json.loads(text)  # type: ignore[arg-type]
        except ValueError as exc:  # it said "--arguments" whichever was given
            raise TargetError(f"{option} is not JSON: {exc}") from exc
    elif tool == "sandbox":
        args = RUN_CODE_PAYLOADS["trivial"]
    elif tool == "search":
        args = {"query": "who wrote the origin of species", "topk": 3}
    else:
        args = {}
    return Target(f"{gateway.rstrip('/')}/v1/tools/{tool}/call", {"arguments": args}, "POST")
