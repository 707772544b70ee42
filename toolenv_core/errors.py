"""Client-error answers every toolenv service gives alike, spelled once.

Malformed JSON is `400 {"detail": NOT_JSON}` on every route of every service (the gateway adds
its `request_id`), whatever the route's own validation errors look like.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ValidationError

NOT_JSON_STATUS = 400
NOT_JSON = "request body is not valid JSON"


def problems(exc: ValidationError) -> list[tuple[str, str]]:
    """Each problem of a validation error as its dotted field path and its message (without
    pydantic's "Value error, " prefix to a validator's own words): what one-line errors name
    (pydantic's own text spans lines and ends in a URL)."""
    return error_problems(exc.errors())


def error_problems(errors: Iterable[Mapping[str, Any]], skip: int = 0) -> list[tuple[str, str]]:
    """`problems` of error dicts as pydantic and FastAPI list them; `skip` leading parts of each
    location (FastAPI's `body`)."""
    return [
        (".".join(str(p) for p in e["loc"][skip:]), str(e["msg"]).removeprefix("Value error, "))
        for e in errors
    ]


def first_problem(exc: ValidationError) -> tuple[str, str]:
    """The dotted field path and the message of a validation error's first problem."""
    return problems(exc)[0]
