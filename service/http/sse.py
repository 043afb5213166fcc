"""Server-sent events as OpenAI clients read them: `data: {json}\\n\\n` ..., then `data: [DONE]\\n\\n`.
A failure once the stream has started ends it with an `error` event carrying OpenAI's error object
(the status line is sent already; a second response must never follow it)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from service.openai.errors import ApiError, from_exception

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream:
    def __init__(self) -> None:
        self.response = web.StreamResponse(headers=HEADERS)
        self.is_ended = False

    @asynccontextmanager
    async def open(self, request: web.Request) -> AsyncIterator[EventStream]:
        """Send the status and headers, then what the block sends. Leaving the block ends the stream; a
        client that went away ends it quietly, a failure with an `error` event."""
        await self.response.prepare(request)
        try:
            yield self
            await self.end()
        except ConnectionResetError:
            pass  # the client went away
        except Exception as error:
            await self._fail_quietly(from_exception(error))

    async def send(self, payload: dict[str, Any], event: str | None = None, event_id: int | None = None) -> None:
        """Raises ConnectionResetError once the client has gone."""
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        head = (f"id: {event_id}\n" if event_id is not None else "") + (f"event: {event}\n" if event else "")
        await self.response.write(f"{head}data: {data}\n\n".encode())

    async def write(self, text: str) -> None:
        await self.response.write(text.encode())

    async def done(self) -> None:
        """The end of an OpenAI stream."""
        await self.response.write(b"data: [DONE]\n\n")
        await self.end()

    async def fail(self, error: ApiError) -> None:
        """End the stream with an `error` event."""
        if not self.is_ended:
            await self.send(error.body(), event="error")
            await self.end()

    async def end(self) -> None:
        if not self.is_ended:
            self.is_ended = True
            await self.response.write_eof()

    async def _fail_quietly(self, error: ApiError) -> None:
        try:
            await self.fail(error)
        except ConnectionResetError:
            pass  # the client went away
