"""Client-error answers every toolenv service gives alike, spelled once.

Malformed JSON is `400 {"detail": NOT_JSON}` on every route of every service (the gateway adds
its `request_id`), whatever the route's own validation errors look like.
"""

from __future__ import annotations

NOT_JSON_STATUS = 400
NOT_JSON = "request body is not valid JSON"
