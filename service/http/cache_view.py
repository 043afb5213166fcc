"""The expert-cache view: `GET /v1/cache/state` (one JSON state) and `GET /v1/cache/events` (the same
state pushed as server-sent events while a client listens).

Both read the snapshot the engine thread published after its last step, so they never touch the
engine. They are public like /metrics: aggregate counters and per-expert routing heat, no prompts or
outputs; and a browser's EventSource cannot send an Authorization header. Being public, the events
take at most `Limits.max_cache_listeners` clients at once; more get 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from aiohttp import web

from engine.async_engine import EngineSnapshot
from engine.expert_cache.stats import BATCH_CLASSES, CacheStatsSnapshot
from service.http.sse import EventStream
from service.http.state import app_state
from service.metrics import EMPTY_CACHE
from service.openai.errors import ApiError
from service.state import ServerState, engine_status

EVENT_INTERVAL_S = 0.5
RECONNECT_MS = 2000  # how long an EventSource waits before it reconnects (e.g. after a restart)
USAGE_DECIMALS = 2
compact_json = functools.partial(json.dumps, separators=(",", ":"))


class Listeners:
    """The event streams open now, at most `cap` of them."""

    def __init__(self, cap: int) -> None:
        self.cap, self.count = cap, 0

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        if self.count >= self.cap:
            raise ApiError(429, f"the cache view has {self.count} listeners already; retry later",
                           code="too_many_listeners")
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1


LISTENERS = web.AppKey("cache_listeners", Listeners)


def setup(app: web.Application, max_listeners: int) -> None:
    app[LISTENERS] = Listeners(max_listeners)


def cache_state(state: ServerState) -> dict[str, Any]:
    """The cache view's JSON: shape, recent use and place of every expert, counters, placement."""
    snap = state.engine.stats()
    status, _ = engine_status(state)
    usage, where = _grids(snap)
    return {
        "time": time.time(),
        "status": status,
        "model": state.model_name,
        "placement": state.engine.description,
        "layers": len(where),
        "experts": len(where[0]) if where else 0,
        "usage": usage,
        "where": where,
        "stats": _stats(snap),
    }


def _grids(snap: EngineSnapshot) -> tuple[list[list[float]], list[list[int]]]:
    """[layers][experts] lists; empty while the model loads."""
    if snap.usage is None or snap.where is None:
        return [], []
    return np.round(snap.usage, USAGE_DECIMALS).tolist(), snap.where.astype(np.int64).tolist()


def _stats(snap: EngineSnapshot) -> dict[str, Any]:
    cache, engine = snap.cache or EMPTY_CACHE, snap.stats
    return {
        "hits": cache.hits(),
        "misses": cache.misses(),
        "hit_ratio": cache.hit_ratio(),
        "recent_hit_ratio": cache.recent_hit_ratio,
        "batch_classes": _batch_classes(cache),
        "groups": [{"group": g.group_id, "device": g.device, "batch_class": g.batch_class, "hits": g.hits,
                    "misses": g.misses, "hit_ratio": g.hit_ratio} for g in cache.groups],
        "devices": [{"device": d.device, "cache_bytes": d.cache_bytes, "slots": d.num_slots, "hits": d.hits,
                     "misses": d.misses, "hit_ratio": d.hit_ratio, "recent_hit_ratio": d.recent_hit_ratio,
                     "promotions": d.promotions, "evictions": d.evictions, "uploaded_bytes": d.uploaded_bytes}
                    for d in cache.devices],
        "uploaded_bytes": cache.uploaded_bytes,
        "streamed_bytes": cache.streamed_bytes,
        "cpu_experts": cache.cpu_experts,
        "promotions": cache.promotions,
        "evictions": cache.evictions,
        "cache_bytes": cache.cache_bytes,
        "slots": cache.num_slots,
        "steps": engine.steps,
        "prompt_tokens": engine.prompt_tokens,
        "generation_tokens": engine.generation_tokens,
        "decode_tokens_per_second": engine.decode_tokens_per_second,
        "requests_running": engine.num_running,
        "requests_waiting": engine.num_waiting,
        "kv_cache_usage": engine.kv_usage,
    }


def _batch_classes(cache: CacheStatsSnapshot) -> dict[str, dict[str, float]]:
    """Every batch class, seen or not, so a client's series never appear and vanish."""
    return {b: {"hits": cache.hits(b), "misses": cache.misses(b), "hit_ratio": cache.hit_ratio(b)}
            for b in BATCH_CLASSES}


async def get_cache_state(request: web.Request) -> web.Response:
    return web.json_response(cache_state(app_state(request)), dumps=compact_json)


async def cache_events(request: web.Request) -> web.StreamResponse:
    """The state every EVENT_INTERVAL_S until the client leaves; ends when the server drains, so an
    open view never holds up a shutdown (the browser reconnects to the next server)."""
    state, events = app_state(request), EventStream()
    with request.app[LISTENERS].hold():
        async with events.open(request):
            await events.write(f"retry: {RECONNECT_MS}\n\n")
            while True:
                await events.send(cache_state(state))
                if engine_status(state)[0] in ("draining", "dead"):
                    break
                await asyncio.sleep(EVENT_INTERVAL_S)
    return events.response
