"""Every error wsserver raises, in one place.

Hierarchy::

    WsServerError
    ├── ProtocolError        the peer sent something we refuse; carries a wire code
    │                        and the request id it concerns (or None).
    ├── ConfigError          the configuration is invalid; the server will not start.
    ├── BackendError         a backend failed; goes over the wire as code ``internal``
    │   └── ModelLoadError   the model could not be loaded.
    ├── PullError            a model could not be pulled from the Hub (a reference that
    │                        does not parse, a file not there, a full disk …); carries a
    │                        wire code of its own (docs/models.md, "Errors").
    ├── GenerationCancelled  raised inside a producer thread when its request was
    │                        cancelled; never leaves the producer.
    └── WireLost             a client's wire is gone (closed, reset, or aborted for
                             reading nothing): raised by a dialect's ``write``, handled
                             by the request driver and the pipeline; never sent.

Only :class:`ProtocolError` and the fixed set of codes in :data:`WIRE_CODES`
(typed as :data:`WireCode`, so a misspelt code fails mypy) ever reach a client; tracebacks and exception text from third-party code never do.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

__all__ = [
    "AUTH_CHALLENGE",
    "CONTEXT_LENGTH_EXCEEDED",
    "WIRE_CODES",
    "BackendError",
    "ConfigError",
    "GenerationCancelled",
    "ModelLoadError",
    "ProtocolError",
    "PullError",
    "WireCode",
    "WireLost",
    "WsServerError",
    "refusal_headers",
]

#: Codes an ``error`` frame (or the ``error`` member of a ``done`` frame with
#: reason ``error``) may carry in protocol v1. Changing this set is a breaking
#: change of the wire protocol.
WireCode = Literal[
    "bad_json",
    "bad_request",
    "unknown_type",
    "duplicate_id",
    "unknown_id",
    "busy",
    "too_large",
    "overloaded",
    "rate_limited",
    "stalled",
    "internal",
    # The openai backend's upstream failed (only inside a ``done`` with reason
    # ``error``); see docs/protocol.md.
    "upstream_unreachable",
    "upstream_rejected",
    "upstream_failed",
    "upstream_timeout",
    "upstream_silent",
    "upstream_bad_stream",
    "upstream_truncated",
    "upstream_unavailable",
    # ``resume`` (and ``cancel`` with a ``resume_token``) refused; see
    # docs/protocol.md, "Resuming a stream".
    "invalid_token",
    "already_attached",
    "seq_out_of_range",
    # A generate option the serving engine cannot honour (it is refused, never
    # ignored); see docs/protocol.md, "Which engine honours what".
    "unsupported_option",
    # The model's tool call could not be read (not JSON, an unknown tool, ...);
    # only inside a ``done`` with reason ``error``.
    "invalid_tool_call",
    # The request named a model this server does not serve (refused before it
    # is queued), or its model failed to load (the requests queued for it).
    "model_not_found",
    "model_load_failed",
    # Pulling a model from the Hugging Face Hub (docs/models.md, "Errors"): a
    # ``pull`` refused, or a pull (or a model's download) that failed.
    "bad_reference",
    "pull_not_allowed",
    "hub_not_found",
    "hub_unauthorized",
    "hub_unreachable",
    "hub_error",
    "download_too_large",
    "disk_full",
    "verification_failed",
]
WIRE_CODES: Final[frozenset[str]] = frozenset(get_args(WireCode))


class WsServerError(Exception):
    """Base class of every wsserver error."""


class ProtocolError(WsServerError):
    """A client frame was refused. ``code`` is one of :data:`WIRE_CODES`."""

    def __init__(
        self,
        code: WireCode,
        message: str,
        request_id: str | None = None,
        *,
        detail: str | None = None,
    ) -> None:
        if code not in WIRE_CODES:
            raise ValueError(f"unknown wire code {code!r}")
        super().__init__(message)
        self.code: WireCode = code
        self.message = message
        self.request_id = request_id
        #: A finer reason than the wire code, for dialects that name it (the
        #: OpenAI API's ``context_length_exceeded``); never on the WebSocket wire.
        self.detail = detail


#: ``ProtocolError.detail`` of a prompt longer than the model's context (wire
#: code ``too_large``; the OpenAI API answers it as OpenAI does, a 400 of this code).
CONTEXT_LENGTH_EXCEEDED: Final = "context_length_exceeded"


class ConfigError(WsServerError):
    """The configuration is invalid; the message says which key and why."""


class BackendError(WsServerError):
    """A backend could not serve a request.

    Reported in the request's ``done`` (reason ``error``) with ``code``:
    ``internal`` by default, or a more precise wire code such as ``too_large``.
    """

    def __init__(self, message: str, *, code: WireCode = "internal") -> None:
        if code not in WIRE_CODES:
            raise ValueError(f"unknown wire code {code!r}")
        super().__init__(message)
        self.code: WireCode = code


class ModelLoadError(BackendError):
    """The model could not be loaded."""


class PullError(WsServerError):
    """A model could not be pulled; ``code`` is its wire code, ``message`` says
    what to do about it (it names the reference, the file, the directory)."""

    def __init__(self, code: WireCode, message: str) -> None:
        if code not in WIRE_CODES:
            raise ValueError(f"unknown wire code {code!r}")
        super().__init__(message)
        self.code: WireCode = code
        self.message = message


class GenerationCancelled(WsServerError):
    """The request was cancelled; the producer unwinds and exits."""


class WireLost(WsServerError):
    """The client's wire is gone: a frame could not be written and never will be.

    The core's own signal, whatever the wire: the socket layer translates its
    library's (websockets' ``ConnectionClosed``, a reset, an abort for making
    no progress) into this at the seam, so that the request driver and the
    pipeline know no transport. A wire that cannot tell (HTTP, whose client
    gone is a cancel) never raises it.
    """


#: The challenge a 401 carries: browsers' plain-HTTP clients may answer Basic
#: (the token as the password), API clients Bearer (docs/operations.md).
AUTH_CHALLENGE: Final = 'Bearer, Basic realm="wsserver", charset="UTF-8"'


def refusal_headers(status: int, *, challenge: str = "Bearer") -> list[tuple[str, str]]:
    """The headers an HTTP refusal carries with its status: when to try again
    (503, 429, and Anthropic's 529), how to authenticate (401). Every HTTP answer takes them here."""
    if status == 401:
        return [("WWW-Authenticate", challenge)]
    if status in (429, 503, 529):
        return [("Retry-After", "1")]
    return []
