"""The OpenAI error object, `{"error": {"message", "type", "param", "code"}}`, for every failure."""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from engine.async_engine import EngineUnavailableError
from engine.types import RequestError

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """An error answered with an HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return web.json_response(self.body(), status=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def from_exception(error: Exception) -> ApiError:
    """The API error for an exception raised while handling a request."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, RequestError):
        return ApiError(400, str(error), error.param, error.code)
    if isinstance(error, EngineUnavailableError):
        return ApiError(503, str(error), code="service_unavailable")
    if isinstance(error, web.HTTPException):
        return _from_http(error)
    log.error("unexpected error", exc_info=error)
    return ApiError(500, "internal server error", code="internal_error")


def _from_http(error: web.HTTPException) -> ApiError:
    if error.status == 413:
        return ApiError(413, f"the request body is too large: {error.text}", code="request_too_large")
    if error.status == 404:
        return ApiError(404, "no such route", code="not_found")
    return ApiError(error.status, error.reason)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: whatever a handler raises becomes an error object, never a crash page."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        return from_exception(error).response()
    except Exception as error:
        return from_exception(error).response()


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object; 413 past the app's client_max_size, 400 for anything not an object."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise bad_request(f"the body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body
