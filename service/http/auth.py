"""Bearer-token authentication; the probe and scrape endpoints, the web page and the cache view stay
public (none of them carries prompts or outputs)."""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from service.http.errors import ApiError

PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version", "/", "/v1/cache/state", "/v1/cache/events"})
PUBLIC_PREFIXES = ("/web/",)  # the page's static files


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def auth_middleware(api_key: str) -> Middleware:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not is_public(request.path):
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            # NOTE: constant time, so the key cannot be guessed byte by byte from response times.
            if not hmac.compare_digest(given, expected):
                raise ApiError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                               code="invalid_api_key")
        return await handler(request)

    return check_key
