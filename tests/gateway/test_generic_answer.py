"""The generic call's answer, written by hand around the tool's reply, is the JSON document the
dict it stands for would be (any request id, error text and elapsed time), strict JSON whatever
the tool wrote (a reply with `NaN` goes in as text), and the deadline the tool is told is the one
`Deadline.headers()` gives."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from gw_support import proxy_tool

from gateway.calls import CallContext
from gateway.dispatch import Outcome, UpstreamCall
from gateway.passthrough import _json_string, generic_call
from gateway.upstream import UpstreamReply
from toolenv_core import headers as h
from toolenv_core.deadline import Deadline, DeadlinePolicy

ODD = ["plain-id.1:2", 'quote"d', "back\\slash", "tab\there", "line\u2028sep", "\ud800", "é", ""]


def strict_loads(raw: bytes | str) -> Any:
    """`json.loads` as RFC 8259 has it: `NaN` and `Infinity` refused, as strict clients do."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(raw, parse_constant=refuse)


@pytest.mark.parametrize("text", ODD)
def test_json_string_is_a_json_string(text: str) -> None:
    assert json.loads(_json_string(text)) == text


class _Config:
    native_path = "/native"


class _Runtime:
    """Just what `generic_call` asks of a tool: its deadline rule and one canned outcome."""

    name = "tool"
    config = _Config()
    deadlines = DeadlinePolicy.from_ms(10_000, 60_000)

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.sent: UpstreamCall | None = None

    def deadline_for(self, header: str | None, body_ms: float | None = None):
        seconds = self.deadlines.budget_s(header, body_ms)
        return Deadline.after(seconds), round(seconds * 1000.0, 3)

    async def call(self, call: UpstreamCall, deadline_ms: float) -> Outcome:
        self.sent = call
        return self.outcome


CASES = [
    ("ok", None, b'{"result": [1, "x"]}', 0.0012345678, "req-1"),
    ("ok", None, b"[1e400, NaN]", 12.5, 'odd"id\\'),  # json.dumps's NaN: not JSON, so text
    ("ok", None, b"[1e400, -1e400]", 0.25, "r0"),  # huge, but JSON: spliced as it came
    ("error", "tool 'tool' answered HTTP 500", b'{"detail": "boom"}', 1e-07, "r"),
    ("error", 'said "no"', b"not json at all", 0.5, "r2"),
    ("ok", None, b"", 3.0, "r3"),
]


@pytest.mark.parametrize(("kind", "error", "body", "elapsed", "request_id"), CASES)
def test_generic_answer_is_the_documented_dict(kind, error, body, elapsed, request_id) -> None:
    headers = {h.EXECUTOR_NODE.lower(): "n1", "retry-after": "3"}
    reply = UpstreamReply(200 if kind == "ok" else 500, body, headers, "u")
    runtime = _Runtime(Outcome(kind, reply=reply, error=error, elapsed_s=elapsed))
    ctx = CallContext(request_id, None, {}, None)
    raw = b'{"arguments": {"q": "x", "n": [1, 2]}}'
    status, headers, answer = asyncio.run(generic_call(ctx, runtime, raw))  # type: ignore[arg-type]
    assert status == 200
    assert (b"content-type", b"application/json") in headers
    assert (h.EXECUTOR_NODE.lower().encode(), b"n1") in headers
    assert (b"retry-after", b"3") in headers  # the tool's own, passed on as the pass-through does
    assert (h.TOOL_STATUS.lower().encode(), kind.encode()) in headers  # as JSON or as text
    try:
        result = strict_loads(body)
    except ValueError:
        result = body.decode() or None
    got = strict_loads(answer)
    assert got == {
        "tool": "tool", "status": kind, "result": result, "error": error,
        "elapsed_s": round(elapsed, 6), "request_id": request_id,
    }  # fmt: skip
    assert runtime.sent is not None and json.loads(runtime.sent.body) == {"q": "x", "n": [1, 2]}


@pytest.mark.parametrize("reserve_s", [0.0, 0.25])
def test_the_deadline_the_tool_is_told(reserve_s: float) -> None:
    deadline = Deadline.after(5.0)
    call = UpstreamCall("POST", "/p", b"", {"a": "b"}, deadline, reserve_s)
    want = Deadline(deadline.at - reserve_s).headers()[h.DEADLINE]
    sent = call.send_headers()
    assert sent["a"] == "b" and abs(int(sent[h.DEADLINE]) - int(want)) <= 1
    assert call.headers == {"a": "b"}  # the call's own headers are not changed
    never = UpstreamCall("POST", "/p", b"", {"a": "b"}, Deadline.never(), reserve_s)
    assert never.send_headers() == {"a": "b"}


def test_a_tool_replying_nan_gets_a_strict_json_answer(gateway, upstream) -> None:
    """A real tool writing `json.dumps`'s `NaN` and `Infinity` (the echo upstream echoes the
    arguments it got): the gateway's answer stays JSON, the reply given as its text."""
    up = upstream("u")
    gw = gateway([proxy_tool("echo", up.url)])
    raw = b'{"arguments": {"score": NaN, "top": Infinity}}'  # accepted, as `json` accepts it
    r = httpx.post(gw.url + "/v1/tools/echo/call", content=raw, timeout=10)
    assert r.status_code == 200, r.text
    got = strict_loads(r.text)
    assert got["status"] == "ok" and got["tool"] == "echo"
    assert isinstance(got["result"], str) and '"score": NaN' in got["result"]
    assert json.loads(got["result"])["body"]["top"] == float("inf")  # lenient readers still can
    fine = httpx.post(gw.url + "/v1/tools/echo/call", json={"arguments": {"x": 1}}, timeout=10)
    assert strict_loads(fine.text)["result"]["body"] == {"x": 1}  # JSON is still spliced
