"""Logging setup: human-readable lines by default, JSON lines on request."""

from __future__ import annotations

import logging
import sys
import time

import orjson

__all__ = ["setup_logging"]


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def setup_logging(*, level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter("%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S")
        formatter.converter = time.localtime
        handler.setFormatter(formatter)
    root = logging.getLogger("wsserver")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    # websockets logs every failed handshake at INFO with a traceback; keep it quieter.
    logging.getLogger("websockets").setLevel(logging.WARNING)
