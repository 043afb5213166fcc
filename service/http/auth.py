"""Bearer-token authentication; the probe and scrape endpoints stay public."""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from service.http.errors import ApiError

PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version"})


def auth_middleware(api_key: str) -> Middleware:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in PUBLIC_PATHS:
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            # NOTE: constant time, so the key cannot be guessed byte by byte from response times.
            if not hmac.compare_digest(given, expected):
                raise ApiError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                               code="invalid_api_key")
        return await handler(request)

    return check_key
