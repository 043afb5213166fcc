"""Every failure of the HTTP API as OpenAI's error object, answered with its HTTP status (an event stream
that has started ends with an `error` event instead: `sse.py`)."""

from __future__ import annotations

import zlib
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestPayloadError

from service.http.state import app_state
from service.openai.body import decode_object
from service.openai.errors import ApiError, bad_request, from_exception

BODY_UNREADABLE = "the request body could not be read: cut short, or not in its Transfer-Encoding"
WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


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
    response = error_response(api_error)
    if is_unreadable:
        # NOTE: nothing of the body can be read past the error: it ends here, and so does the connection
        # after this answer (aiohttp would otherwise try to drain the body, and fail and log again).
        request.content.feed_eof()
        response.force_close()
    return response


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object within the bounds of `decode_object`; 413 past the app's client_max_size."""
    max_bytes = app_state(request).limits.max_body_bytes
    return decode_object(decoded(await request.read(), content_coding(request), max_bytes))


def content_coding(request: web.Request) -> str:
    """The body's Content-Encoding: identity, or one this API decodes itself (gzip, deflate); 415 for others.
    NOTE: the server does not decode bodies (auto_decompress=False), so a body that does not decode is an
    error of this request, answered as JSON, never a parser error before any route."""
    coding = request.headers.get("Content-Encoding", "identity").strip().lower() or "identity"
    if coding != "identity" and coding not in WBITS:
        raise ApiError(415, f"Content-Encoding {coding[:40]!r} is not supported: send gzip, deflate or identity",
                       code="unsupported_content_encoding")
    return coding


def decoded(raw: bytes, coding: str, max_bytes: int) -> bytes:
    """`raw` decompressed, at most `max_bytes` of it (413 past that)."""
    if coding == "identity":
        return raw
    inflater = zlib.decompressobj(WBITS[coding])
    try:
        data = inflater.decompress(raw, max_bytes + 1)
    except zlib.error:
        raise bad_request(f"the body is not {coding} data (its Content-Encoding)") from None
    if len(data) > max_bytes:
        raise ApiError(413, f"the request body is larger than {max_bytes} bytes decompressed", code="request_too_large")
    if not inflater.eof:
        raise bad_request(f"the {coding} body is cut short")
    return data
