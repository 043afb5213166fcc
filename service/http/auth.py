"""Bearer-token authentication; the probe and scrape endpoints, the web page and the cache view stay
public (none of them carries prompts or outputs)."""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from service.openai.auth import is_authorized
from service.openai.errors import ApiError

PUBLIC_PATHS = frozenset({"/health", "/metrics", "/version", "/", "/v1/cache/state", "/v1/cache/events"})
PUBLIC_PREFIXES = ("/web/",)  # the page's static files


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def auth_middleware(api_key: str) -> Middleware:
    @web.middleware
    async def check_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not is_public(request.path) and not is_authorized(request.headers.get("Authorization"), api_key):
            raise ApiError(401, "missing or invalid API key (Authorization: Bearer <key>)", code="invalid_api_key")
        return await handler(request)

    return check_key
