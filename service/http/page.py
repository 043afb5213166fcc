"""The web page: `/` and its static files under `/web/` (plain HTML, CSS and JavaScript modules
shipped as package data in `service/web/`)."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from service.openai.errors import ApiError

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
# NOTE: only the files shipped are served, each by its name: no path from a request reaches the file system.
WEB_FILES = frozenset(p.name for p in WEB_DIR.iterdir() if p.is_file())
# The page loads nothing from elsewhere and talks only to this server.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(WEB_DIR / "index.html", headers=PAGE_HEADERS)


async def static_file(request: web.Request) -> web.FileResponse:
    name = request.match_info["name"]
    if name not in WEB_FILES:
        raise ApiError(404, "no such file", code="not_found")
    return web.FileResponse(WEB_DIR / name, headers={"X-Content-Type-Options": "nosniff"})


def routes() -> list[web.RouteDef]:
    return [web.get("/", index), web.get("/web/{name}", static_file)]
