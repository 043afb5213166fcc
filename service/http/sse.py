"""Server-sent events as OpenAI clients read them: `data: {json}\\n\\n` ..., then `data: [DONE]\\n\\n`."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream:
    def __init__(self) -> None:
        self.response = web.StreamResponse(headers=HEADERS)

    async def start(self, request: web.Request) -> None:
        """Send the status and headers; from here on errors travel in band."""
        await self.response.prepare(request)

    async def send(self, payload: dict[str, Any]) -> None:
        """Raises ConnectionResetError once the client has gone."""
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        await self.response.write(f"data: {data}\n\n".encode())

    async def done(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
