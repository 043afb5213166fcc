"""The web page: `/` and its static files under `/web/` (plain HTML, CSS and JavaScript modules
shipped as package data in `service/web/`)."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web
from aiohttp.web_routedef import AbstractRouteDef

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
STATIC_PREFIX = "/web"
# The page loads nothing from elsewhere and talks only to this server.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(WEB_DIR / "index.html", headers=PAGE_HEADERS)


def routes() -> list[AbstractRouteDef]:
    return [web.get("/", index), web.static(STATIC_PREFIX, WEB_DIR)]
