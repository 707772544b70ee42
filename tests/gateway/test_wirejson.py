"""The hot routes' JSON (pydantic-core with `json` as the fallback) accepts, refuses and writes
what `json` does: the malformed-JSON answer and the generic call's splice depend on it."""

from __future__ import annotations

import json
import math

import pytest

from gateway import wirejson

BODIES = [
    b'{"a": 1, "a": 2}',  # the last duplicate wins
    b" [1, 2.5, -0, 123456789012345678901234567890] ",
    b'"\\ud800"',  # a lone surrogate escape: pydantic-core refuses it, json takes it
    b'{"e": "\xc3\xa9"}',
    b"NaN",
    b"[1e400]",
]
REFUSED = [b"", b"[1,]", b'{"a": 1}x', b'"\xff"', b"{'a': 1}"]


@pytest.mark.parametrize("body", BODIES)
def test_what_json_takes_is_taken_alike(body: bytes) -> None:
    got, want = wirejson.loads(body), json.loads(body)
    if isinstance(want, float) and math.isnan(want):
        assert math.isnan(got)
    else:
        assert got == want
    assert wirejson.is_json(body)


@pytest.mark.parametrize("body", REFUSED)
def test_what_json_refuses_is_refused(body: bytes) -> None:
    assert not wirejson.is_json(body)
    if body:
        with pytest.raises(ValueError):
            wirejson.loads(body)


@pytest.mark.parametrize(
    "value", [{"k": [1, 2.5, None, True]}, {"s": "\ud800"}, {"e": "é"}, [math.inf], 10**30]
)
def test_what_is_written_reads_back_as_the_same_document(value: object) -> None:
    assert json.loads(wirejson.dumps(value)) == value


def test_a_byte_order_mark_is_parsed_as_json_parses_bytes_but_is_no_reply_to_splice() -> None:
    body = b"\xef\xbb\xbf[1]"
    assert wirejson.loads(body) == json.loads(body) == [1]
    assert not wirejson.is_json(body)  # a tool's reply with a BOM goes out as text, as before


@pytest.mark.parametrize("body", [b"NaN", b"[1, Infinity]", b'{"a": -Infinity}', b'"\\ud800" '])
def test_strict_refuses_what_rfc_8259_refuses(body: bytes) -> None:
    """`NaN` and the infinities (`json`'s, not JSON's) are refused by both parsers when strict;
    the fallback's other acceptance (a lone surrogate escape) is kept."""
    assert wirejson.is_json(body)
    assert wirejson.is_json(body, strict=True) is body.startswith(b'"')
    assert wirejson.is_json(b"[1e400]", strict=True)  # huge, but JSON
