"""Client-error answers every toolenv service gives alike, spelled once.

Malformed JSON is `400 {"detail": NOT_JSON}` on every route of every service (the gateway adds
its `request_id`), whatever the route's own validation errors look like.
"""

from __future__ import annotations

from pydantic import ValidationError

NOT_JSON_STATUS = 400
NOT_JSON = "request body is not valid JSON"


def first_problem(exc: ValidationError) -> tuple[str, str]:
    """The dotted field path and the message of a validation error's first problem: what a
    one-line error names (pydantic's own text spans lines and ends in a URL)."""
    first = exc.errors()[0]
    return ".".join(str(p) for p in first["loc"]), first["msg"].removeprefix("Value error, ")
