"""Server limits and admission: how many requests generate at once, how many may wait, the rest 429."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from service.openai.errors import ApiError


@dataclass(frozen=True)
class Limits:
    max_tokens: int = field(default=4096, metadata={
        "flag": "--max-tokens-limit", "metavar": "N", "help": "the largest max_tokens a request may ask for"})
    max_concurrent_requests: int = field(default=64, metadata={
        "flag": "--max-concurrent-requests", "metavar": "N", "help": "generation requests handed to the engine "
        "at once"})
    max_queued_requests: int = field(default=256, metadata={
        "flag": "--max-queued-requests", "metavar": "N", "help": "requests waiting for a turn beyond the "
        "concurrent ones; more get 429"})
    max_body_bytes: int = field(default=1 << 20, metadata={
        "flag": "--max-body-bytes", "metavar": "N", "help": "larger request bodies get 413"})
    max_stop_strings: int = field(default=16, metadata={
        "flag": "--max-stop-strings", "metavar": "N", "help": "stop strings of one request"})
    max_n: int = field(default=8, metadata={
        "flag": "--max-n", "metavar": "N", "help": "choices per request (n x prompts)"})
    max_cache_listeners: int = 32  # clients of the public /v1/cache/events at once; more get 429

    def __post_init__(self) -> None:
        positive = ("max_tokens", "max_concurrent_requests", "max_body_bytes", "max_n", "max_cache_listeners")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (got {getattr(self, name)})")
        if self.max_queued_requests < 0 or self.max_stop_strings < 0:
            raise ValueError("max_queued_requests and max_stop_strings must be >= 0")


class Admission:
    """A turn for each generation request: at most `max_running` at once, `max_queued` waiting."""

    def __init__(self, max_running: int, max_queued: int) -> None:
        self.max_queued = max_queued
        self.num_running = 0
        self.num_queued = 0
        self._turns = asyncio.Semaphore(max_running)
        self._idle = asyncio.Event()
        self._idle.set()

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        if self._turns.locked() and self.num_queued >= self.max_queued:
            raise ApiError(429, f"too many requests: {self.num_running} running and {self.num_queued} "
                           "waiting; retry later", code="too_many_requests")
        self._idle.clear()
        self.num_queued += 1
        try:
            await self._turns.acquire()
        finally:
            self.num_queued -= 1
            self._set_idle()
        self.num_running += 1
        try:
            yield
        finally:
            self.num_running -= 1
            self._turns.release()
            self._set_idle()

    def _set_idle(self) -> None:
        if self.num_running == 0 and self.num_queued == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request holds or waits for a turn; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True
