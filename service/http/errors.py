"""Every failure of the HTTP API as OpenAI's error object, answered with its HTTP status (an event stream
that has started ends with an `error` event instead: `sse.py`)."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestPayloadError

from service.openai.body import decode_object
from service.openai.errors import ApiError, from_exception

BODY_UNREADABLE = "the request body could not be read: a Content-Encoding it does not have, or cut short"


def error_response(error: ApiError) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return web.json_response(error.body(), status=error.status, headers=headers)


def _from_http(error: web.HTTPException) -> ApiError:
    if error.status == 413:
        return ApiError(413, f"the request body is too large: {error.text}", code="request_too_large")
    if error.status == 404:
        return ApiError(404, "no such route", code="not_found")
    return ApiError(error.status, error.reason)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: whatever a handler raises becomes an error object, never a crash page."""
    is_unreadable = False
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        api_error = _from_http(error)
    except (RequestPayloadError, HttpProcessingError):
        api_error, is_unreadable = ApiError(400, BODY_UNREADABLE, code="invalid_body"), True
    except Exception as error:
        # NOTE: a response that has started cannot be followed by another; event streams end themselves
        # (`EventStream.open`), anything else is aiohttp's to cut off.
        if request.writer.output_size > 0:
            raise
        api_error = from_exception(error)
    if is_unreadable:
        request.protocol.force_close()  # the rest of the body cannot be read past the error either
    return error_response(api_error)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object within the bounds of `decode_object`; 413 past the app's client_max_size."""
    return decode_object(await request.read())
