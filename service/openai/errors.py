"""The OpenAI error object, `{"error": {"message", "type", "param", "code"}}`, for every failure; each
transport renders it (an HTTP status, an SSE `error` event, a gRPC status)."""

from __future__ import annotations

import logging
import re
from typing import Any

from engine.async_engine import EngineUnavailableError
from engine.types import RequestError

log = logging.getLogger(__name__)

SURROGATE = re.compile("[\ud800-\udfff]")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """A failure answered with a status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        message = printable(message)
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def printable(text: str) -> str:
    """`text` with unpaired surrogates (from a request's bytes) as U+FFFD, so any JSON encoder takes it."""
    return text if text.isascii() else SURROGATE.sub("\ufffd", text)


def from_exception(error: BaseException) -> ApiError:
    """The API error for an exception raised while serving a request. An unexpected one is logged and
    answered 500 with a fixed message: its text and class are the server's business, not the client's."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, RequestError):
        return ApiError(400, str(error), error.param, error.code)
    if isinstance(error, EngineUnavailableError):
        return ApiError(503, str(error), code="service_unavailable")
    log.error("unexpected error", exc_info=error)
    return ApiError(500, "internal server error", code="internal_error")
