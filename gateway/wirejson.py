"""JSON on the hot routes: pydantic-core's Rust parser and serializer, with the standard library's
as the fallback that keeps its exact acceptance.

Why: each hot call parses its request body (the one malformed-JSON answer), and the generic call
also checks its tool's reply before splicing it and writes the tool's arguments: with `json` that
was about 5 us of a generic call (a 3.4 kB search reply alone took 3.4 us to check; pydantic-core
0.9 us). What pydantic-core refuses and `json` takes (a lone surrogate escape, UTF-16 with a BOM,
nesting past its depth limit) is retried with `json`, so no body is accepted or refused
differently than before; only rare, odd bodies pay twice.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic_core import from_json, to_json


def loads(raw: bytes) -> Any:
    """Like `json.loads(raw)`; raises ValueError for malformed JSON, and for JSON nested deeper than
    `json` can parse (its RecursionError was a 500)."""
    try:
        return from_json(raw)
    except ValueError:
        try:
            return json.loads(raw)
        except RecursionError as exc:
            raise ValueError("JSON nested too deeply") from exc


def is_json(body: bytes, *, strict: bool = False) -> bool:
    """Whether `body` is one well-formed UTF-8 JSON document. `strict`: as RFC 8259 has it, so
    not with `NaN` or `Infinity` (which `json` reads and writes, and strict parsers refuse): a
    reply the gateway puts inside its own answer must be strict, or the answer is not JSON."""
    if not body:
        return False
    try:
        from_json(body, allow_inf_nan=not strict)
    except ValueError:
        try:
            json.loads(body.decode("utf-8"), parse_constant=_refuse if strict else None)
        except (ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError, nesting
            return False
    return True


def _refuse(constant: str) -> Any:
    """`json`'s hook for `NaN`, `Infinity` and `-Infinity`: not JSON, for a strict check."""
    raise ValueError(f"{constant} is not JSON (RFC 8259)")


def dumps(value: Any) -> bytes:
    """`value` as compact UTF-8 JSON (NaN and infinities written as `json` writes them)."""
    try:
        return to_json(value)
    except ValueError:  # e.g. a lone surrogate, which only `json` can write (escaped)
        return json.dumps(value).encode()
