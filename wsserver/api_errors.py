"""OpenAI's error object, shared by the OpenAI-shaped dialects (sans-I/O).

Both HTTP dialects — chat/completions (:mod:`wsserver.openai_api`) and the
Responses API (:mod:`wsserver.responses_api`) — refuse and fail with the same
object, ``{"error": {"message", "type", "param", "code"}}``, and the same
HTTP status per wire code; the HTTP transport (:mod:`wsserver.aio.openai_http`)
turns an :class:`ApiError` raised by either into its response. It lives here,
outside both dialects, because what dialects share must not be one dialect's.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Final

import orjson

from .errors import ProtocolError, WireCode

__all__ = ["ApiError", "error_body", "error_object", "status_of"]

#: The HTTP status of each wire code a request can be refused or fail with.
_STATUS: Final[dict[str, HTTPStatus]] = {
    "bad_json": HTTPStatus.BAD_REQUEST,
    "bad_request": HTTPStatus.BAD_REQUEST,
    "unsupported_option": HTTPStatus.BAD_REQUEST,
    "model_not_found": HTTPStatus.NOT_FOUND,
    "too_large": HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
    "rate_limited": HTTPStatus.TOO_MANY_REQUESTS,
    "overloaded": HTTPStatus.SERVICE_UNAVAILABLE,
    "stalled": HTTPStatus.SERVICE_UNAVAILABLE,
}
_TYPES: Final[dict[int, str]] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def status_of(code: WireCode) -> HTTPStatus:
    """The HTTP status for a wire code (502 for an upstream's failure, else 500)."""
    status = _STATUS.get(code)
    if status is not None:
        return status
    return (
        HTTPStatus.BAD_GATEWAY if code.startswith("upstream_") else HTTPStatus.INTERNAL_SERVER_ERROR
    )


class ApiError(Exception):
    """A request refused or failed, as OpenAI reports it."""

    def __init__(
        self, status: HTTPStatus, message: str, code: str, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    @classmethod
    def from_protocol(cls, exc: ProtocolError) -> ApiError:
        return cls(status_of(exc.code), exc.message, exc.code)

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.code, self.param)


def in_dialect_names(message: str, names: dict[str, str]) -> str:
    """An engine's refusal (``bad_request``, ``unsupported_option``) with each
    quoted core field name (``'json_schema'``) replaced by the dialect's own
    (``names``: core → dialect), for the dialects whose fields are named
    differently from the core's."""
    for ours, theirs in names.items():
        if ours != theirs:
            message = message.replace(f"'{ours}'", f"'{theirs}'")
    return message


def error_object(status: int, message: str, code: str, param: str | None) -> dict[str, Any]:
    """The ``error`` member: message, type (from the status), param, code."""
    kind = _TYPES.get(status, "server_error")
    return {"message": message, "type": kind, "param": param, "code": code}


def error_body(status: int, message: str, code: str, param: str | None = None) -> bytes:
    """OpenAI's error object as a JSON body."""
    return orjson.dumps({"error": error_object(status, message, code, param)})
