"""Numeric request fields that refuse JSON booleans, for every service's wire models.

pydantic's lax mode reads `true` as 1 for an int or float field, so `"run_timeout": true` was a
one-second run and `"topk": true` one document. Strict mode would refuse that, but also `"5"`
and `5.0` for an int, which SandboxFusion (lax pydantic) accepts: these types refuse exactly the
booleans and keep every other reading, so SandboxFusion's clients see no other change.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError


def _not_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise PydanticCustomError(
            "bool_not_number",
            "must be a number, not {value} (a JSON boolean is not read as 0 or 1)",
            {"value": str(value).lower()},
        )
    return value


NOT_BOOL = BeforeValidator(_not_bool)

Number = Annotated[float, NOT_BOOL]
"""A float field (seconds, cores, ...): ints and floats as sent, never a boolean."""

Integer = Annotated[int, NOT_BOOL]
"""An int field (megabytes, bytes, counts): as pydantic reads an int, never a boolean."""
