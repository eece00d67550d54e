"""A request's last log line, the same for every wire.

Every request ends with exactly one ``done`` (or is refused with one
``error``), and the request driver (:mod:`wsserver.aio.driver`) logs it as it
writes it: :func:`log_done` — the reason, the token counts and the times that
explain a slow answer after the fact (queued, time to first token, total,
tokens per second), as text and as the JSON log's fields.
"""

from __future__ import annotations

from typing import Any

from ..core.protocol import Done

__all__ = ["log_done"]


def log_done(log: Any, frame: Done) -> None:
    """The one log line of a finished request, WebSocket or HTTP alike."""
    timings = frame.timings
    log.info(
        "done %s",
        _done_summary(frame),
        extra={
            "reason": frame.reason,
            "model": frame.model,
            "queued_ms": round(timings.queued_ms, 3),
            "ttft_ms": None if timings.ttft_ms is None else round(timings.ttft_ms, 3),
            "total_ms": round(timings.total_ms, 3),
            "completion_tokens": frame.usage.completion_tokens,
        },
    )


def _done_summary(frame: Done) -> str:
    usage, timings = frame.usage, frame.timings
    ttft = "-" if timings.ttft_ms is None else f"{timings.ttft_ms:.1f}ms"
    return (
        f"reason={frame.reason} prompt_tokens={usage.prompt_tokens} "
        f"completion_tokens={usage.completion_tokens} queued={timings.queued_ms:.1f}ms "
        f"ttft={ttft} total={timings.total_ms:.1f}ms tok/s={timings.tokens_per_s:.1f}"
        + (f" model={frame.model}" if frame.model is not None else "")
    )
