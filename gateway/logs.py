"""Structured JSON logs: one object per line, with whatever `extra={...}` a call site passed."""

from __future__ import annotations

import json
import logging
import sys
import time

_STANDARD = set(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str = "info", also: tuple[str, ...] = ()) -> None:
    """Route the gateway's logger, and the loggers `also` names (the tools served in its process),
    to stderr as JSON (called once by the CLI, not at import): the embedded sandboxd's warnings
    came as bare text through logging's last resort, its info lines not at all."""
    for name in ("toolenv.gateway", *also):
        logger = logging.getLogger(name)
        logger.setLevel(level.upper())
        if not any(isinstance(h.formatter, JsonFormatter) for h in logger.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(JsonFormatter())
            logger.addHandler(handler)
        logger.propagate = False
