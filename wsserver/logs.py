"""Logging setup: human-readable lines by default, JSON lines on request."""

from __future__ import annotations

import logging
import sys
import time

import orjson

__all__ = ["JsonFormatter", "context", "setup_logging"]

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD_ATTRS = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


def context(conn: str, request: str | None = None, **fields: object) -> dict[str, object]:
    """``extra=`` for a log line about a connection and (optionally) one request.

    The JSON formatter emits these as fields (``conn``, ``request``, timings),
    so a log line can be found by ID without parsing its message.
    """
    out: dict[str, object] = {"conn": conn}
    if request is not None:
        out["request"] = request
    out.update(fields)
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, then any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def setup_logging(*, level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter(
            "%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S"
        )
        formatter.converter = time.localtime
        handler.setFormatter(formatter)
    root = logging.getLogger("wsserver")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    # websockets logs every failed handshake at INFO with a traceback; keep it quieter.
    logging.getLogger("websockets").setLevel(logging.WARNING)
