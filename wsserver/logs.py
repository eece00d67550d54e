"""Logging setup: human-readable lines by default, JSON lines on request.

Two things keep the log useful while somebody attacks the server:

* **Nothing a client chose reaches the terminal raw.** Paths, headers, request
  ids and close reasons are the client's bytes; an ESC, CR or BEL among them
  would rewrite the operator's terminal or forge log lines. Both formatters
  escape control characters (C0, DEL, C1) in everything they write, whatever
  logger the record came from, so no call site has to remember to.
* **Repeated errors are rate-limited.** A client can make websockets or
  asyncio log a traceback per connection, and running out of file descriptors
  makes asyncio log one per accept. :class:`RepeatFilter` lets the first
  record of a kind through, drops the same kind for ``interval`` seconds, and
  says on the next one it lets through how many it dropped.

The same handler serves ``wsserver``, ``websockets`` and ``asyncio``.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, MutableMapping
from typing import IO, Any

import orjson

__all__ = [
    "ConnectionLog",
    "JsonFormatter",
    "RepeatFilter",
    "TextFormatter",
    "context",
    "escape_controls",
    "setup_logging",
]

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD_ATTRS = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}

_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROLS_BUT_NEWLINE = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")

#: Loggers whose records go through our handler (and so are escaped and rate-limited).
_LOGGERS = ("wsserver", "websockets", "asyncio")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}"


def escape_controls(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with control characters written as ``\\xNN`` (one line, unless told)."""
    pattern = _CONTROLS_BUT_NEWLINE if keep_newlines else _CONTROLS
    return pattern.sub(_escape, text)


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


_NO_REQUEST: Any = object()


class ConnectionLog(logging.LoggerAdapter[logging.Logger]):
    """The log of one connection (and, from :meth:`request`, one of its requests).

    Every line starts ``conn=<id>`` (and ``id=<request>``) and carries the
    same IDs as :func:`context` fields, so call sites write only what the line
    is about: ``log.info("cancel")``. Extra fields go in ``extra=`` as usual.
    """

    def __init__(
        self, logger: logging.Logger, conn_id: str, request_id: str | None = _NO_REQUEST
    ) -> None:
        super().__init__(logger, {})
        self.conn_id = conn_id
        self.request_id = request_id
        # The IDs are ours or validated (no "%" in either), but stay literal anyway.
        prefix = (
            f"conn={conn_id}" if request_id is _NO_REQUEST else f"conn={conn_id} id={request_id}"
        )
        self._prefix = prefix.replace("%", "%%") + " "
        self._fields = context(conn_id, None if request_id is _NO_REQUEST else request_id)

    def request(self, request_id: str | None) -> ConnectionLog:
        """The log of one request of this connection (``id=None``: a frame without one)."""
        return ConnectionLog(self.logger, self.conn_id, request_id)

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**self._fields, **(kwargs.get("extra") or {})}
        return self._prefix + str(msg), kwargs


class TextFormatter(logging.Formatter):
    """``HH:MM:SS.mmm LEVEL logger: message``, control characters escaped.

    A traceback keeps its line breaks (it is ours, and multi-line by nature)
    but loses every other control character.
    """

    def __init__(self) -> None:
        super().__init__(
            "%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S"
        )
        self.converter = time.localtime

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape_controls(super().formatMessage(record))

    def formatException(self, ei: object) -> str:
        return escape_controls(super().formatException(ei), keep_newlines=True)  # type: ignore[arg-type]

    def formatStack(self, stack_info: str) -> str:
        return escape_controls(super().formatStack(stack_info), keep_newlines=True)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, message, then any ``extra`` fields.

    JSON escapes C0 characters by itself; DEL and C1 characters are escaped
    here too, since a terminal tailing the log may act on them.
    """

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": escape_controls(record.getMessage()),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and key not in entry:
                entry[key] = escape_controls(value) if isinstance(value, str) else value
        if record.exc_info:
            entry["exc"] = escape_controls(
                self.formatException(record.exc_info), keep_newlines=True
            )
        return escape_controls(orjson.dumps(entry, default=str).decode())


_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+(?:\.\d+)?")


def _template(message: object) -> str:
    """What makes two records "the same kind": the first line of the message
    with numbers, addresses and ids blanked. asyncio and websockets format
    their messages before logging (a handle's time, an object's address, a
    file descriptor), so the raw template alone would make every one new."""
    first = str(message).split("\n", 1)[0][:200]
    return _NUMBERS.sub("#", first)


class RepeatFilter(logging.Filter):
    """Let one record of a kind through per ``interval`` seconds; count the rest.

    A kind is (logger, level, message template with numbers blanked, exception
    type). Records below
    ``level`` always pass. The first record of a kind after a quiet interval
    passes with ``(N similar suppressed in the last Ts)`` appended when any
    were dropped. At most ``max_kinds`` kinds are remembered (oldest forgotten).
    """

    def __init__(
        self,
        *,
        interval: float = 10.0,
        level: int = logging.WARNING,
        max_kinds: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.interval = interval
        self.level = level
        self.max_kinds = max_kinds
        self._clock = clock
        # kind -> [time of the last record let through, records dropped since]
        self._kinds: OrderedDict[tuple[object, ...], list[float]] = OrderedDict()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < self.level:
            return True
        exc_type = record.exc_info[0] if record.exc_info else None
        kind = (record.name, record.levelno, _template(record.msg), exc_type)
        now = self._clock()
        entry = self._kinds.get(kind)
        if entry is not None and now - entry[0] < self.interval:
            entry[1] += 1
            return False
        if entry is not None and entry[1]:
            suppressed, since = int(entry[1]), now - entry[0]
            record.msg = f"{record.msg} ({suppressed} similar suppressed in the last {since:.0f}s)"
        self._kinds[kind] = [now, 0]
        self._kinds.move_to_end(kind)
        while len(self._kinds) > self.max_kinds:
            self._kinds.popitem(last=False)
        return True


def setup_logging(
    *,
    level: str = "info",
    fmt: str = "text",
    repeat_interval: float = 10.0,
    stream: IO[str] | None = None,
) -> None:
    """Send the wsserver, websockets and asyncio loggers to ``stream`` (stderr)."""
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RepeatFilter(interval=repeat_interval))
    for name in _LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
    logging.getLogger("wsserver").setLevel(level.upper())
    # websockets logs every failed handshake at INFO with a traceback; keep it quieter.
    logging.getLogger("websockets").setLevel(logging.WARNING)
    logging.getLogger("asyncio").setLevel(logging.WARNING)
