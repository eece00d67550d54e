"""What the API dialects share about a refusal (sans-I/O): OpenAI's error
object, the HTTP status of each wire code, and the JSON body check.

Every HTTP dialect — chat/completions (:mod:`wsserver.dialects.openai.api`), the
Responses API (:mod:`wsserver.dialects.responses.api`), Anthropic's Messages API
(:mod:`wsserver.dialects.anthropic.api`, which writes the same :class:`ApiError` in its
own shape) — refuses with an :class:`ApiError`: its HTTP status, its wire
code. The OpenAI-shaped ones write it as ``{"error": {"message", "type",
"param", "code"}}``; the HTTP router (:mod:`wsserver.aio.http_router`) turns
one raised by any route into its response. A body that is no JSON object is
refused the same way everywhere (:func:`parse_json`). It lives here, outside
the dialects, because what dialects share must not be one dialect's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final

import orjson

from ..errors import ProtocolError, WireCode

__all__ = [
    "ERROR_TYPES",
    "ApiError",
    "Fields",
    "error_body",
    "error_object",
    "parse_json",
    "status_of",
]

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
#: OpenAI's error ``type`` of each status it answers with (else ``server_error``).
ERROR_TYPES: Final[dict[int, str]] = {
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
    kind = ERROR_TYPES.get(status, "server_error")
    return {"message": message, "type": kind, "param": param, "code": code}


def error_body(status: int, message: str, code: str, param: str | None = None) -> bytes:
    """OpenAI's error object as a JSON body."""
    return orjson.dumps({"error": error_object(status, message, code, param)})


def parse_json(body: bytes | str) -> dict[str, Any]:
    """A request body (or a WebSocket-mode event) that must be a JSON object,
    or :class:`ApiError` ``bad_json``."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"invalid JSON: {exc.msg}", "bad_json") from None
    if not isinstance(obj, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object", "bad_json")
    return obj


@dataclass(frozen=True, slots=True)
class Fields:
    """A dialect's top-level fields — honour or refuse, never ignore: each is
    honoured, accepted only with values that change nothing we produce
    (``harmless``: a check per field), or refused with a reason; any other is
    unknown, and refused as such."""

    honoured: frozenset[str]
    harmless: Mapping[str, Callable[[Any], bool]]
    refused: Mapping[str, str]

    def refusal(self, name: str, value: Any) -> str | None:
        """Why the field is refused as given: its reason, or ``""`` for a field
        no table names (unknown); None when it is honoured or harmless."""
        if name in self.honoured:
            return None
        harmless = self.harmless.get(name)
        if harmless is not None and harmless(value):
            return None
        return self.refused.get(name, "")
