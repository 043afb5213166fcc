"""The cache view's endpoints over raw HTTP: `/v1/cache/state` (shape, values that follow traffic),
`/v1/cache/events` (a state per event, ending when the server drains); the page and its static files;
which paths stay public when the server requires an API key."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from http_servers import ServerThread, engine_config, greedy
from prometheus_client.parser import text_string_to_metric_families
from yarl import URL

from engine.expert_cache.stats import BATCH_CLASSES
from service.server import ServeOptions

STATE = "/v1/cache/state"
EVENTS = "/v1/cache/events"
STAT_FIELDS = {"hits", "misses", "hit_ratio", "recent_hit_ratio", "batch_classes", "groups", "devices",
               "uploaded_bytes", "streamed_bytes", "cpu_experts", "promotions", "evictions", "cache_bytes", "slots",
               "steps", "prompt_tokens", "generation_tokens", "decode_tokens_per_second", "requests_running",
               "requests_waiting", "kv_cache_usage"}


async def get_state(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(url) as r:
        assert r.status == 200 and r.content_type == "application/json"
        return await r.json()


async def read_state_events(response: aiohttp.ClientResponse, count: int) -> list[dict[str, Any]]:
    events = []
    async for line in response.content:
        if line.startswith(b"data: "):
            events.append(json.loads(line[len(b"data: "):]))
            if len(events) == count:
                break
    return events


async def test_state_has_the_grid_and_the_counters(http: aiohttp.ClientSession, server: ServerThread) -> None:
    state = await get_state(http, server.url(STATE))
    assert set(state) == {"time", "status", "model", "placement", "layers", "experts", "usage", "where", "stats"}
    assert (state["status"], state["model"], state["layers"], state["experts"]) == ("ok", "tiny", 2, 8)
    assert "host RAM" in state["placement"]
    for grid, kind in ((state["usage"], float), (state["where"], int)):
        assert len(grid) == 2 and all(len(row) == 8 and all(isinstance(v, kind) for v in row) for row in grid)
    # the tiny model behind a 1 MiB cache: every routed expert in host RAM, some of them in slots
    assert all(w in (0, 1) for row in state["where"] for w in row)
    assert sum(w == 1 for row in state["where"] for w in row) <= state["stats"]["slots"]
    assert set(state["stats"]) == STAT_FIELDS
    assert set(state["stats"]["batch_classes"]) == set(BATCH_CLASSES)
    assert [(d["device"], d["slots"]) for d in state["stats"]["devices"]] == [("cpu", state["stats"]["slots"])]


async def test_state_follows_the_traffic(http: aiohttp.ClientSession, server: ServerThread) -> None:
    before = await get_state(http, server.url(STATE))
    async with http.post(server.url("/v1/completions"), json=greedy(max_tokens=8, prompt="hello there")) as r:
        assert r.status == 200
    after = await get_state(http, server.url(STATE))
    b, a = before["stats"], after["stats"]
    assert a["generation_tokens"] == b["generation_tokens"] + 8
    assert a["hits"] + a["misses"] > b["hits"] + b["misses"] and after["time"] > before["time"]
    decode = a["batch_classes"]["<=8"]
    assert decode["hits"] + decode["misses"] > 0 and 0.0 <= decode["hit_ratio"] <= 1.0
    # recent picks: 8 decode steps of top-2 routing leave heat on the experts just used
    assert sum(map(sum, after["usage"])) > 0
    assert any(w == 1 for row in after["where"] for w in row), "the cache holds some experts after traffic"


async def test_events_push_the_state_repeatedly(http: aiohttp.ClientSession, server: ServerThread) -> None:
    async with http.get(server.url(EVENTS)) as r:
        assert r.status == 200 and r.content_type == "text/event-stream"
        events = await asyncio.wait_for(read_state_events(r, 3), 10)
    assert [e["layers"] for e in events] == [2, 2, 2]
    times = [e["time"] for e in events]
    assert times == sorted(times) and times[-1] - times[0] >= 0.5, "events are spaced by the push interval"


async def test_events_end_when_the_server_drains(http: aiohttp.ClientSession, tiny_gguf: Path) -> None:
    srv = ServerThread(engine_config(tiny_gguf), ServeOptions(port=0)).start()
    try:
        async with http.get(srv.url(EVENTS)) as r:
            await read_state_events(r, 1)
            stopping = threading.Thread(target=srv.stop)
            stopping.start()
            rest = await asyncio.wait_for(r.content.read(), 10)  # the stream closes instead of hanging
    finally:
        await asyncio.to_thread(stopping.join, 30)
    last = json.loads(rest.decode().strip().split("\n")[-1][len("data: "):])
    assert last["status"] == "draining"


@pytest.fixture(scope="module")
def keyed_server(tiny_gguf: Path) -> Iterator[ServerThread]:
    srv = ServerThread(engine_config(tiny_gguf, cached=True), ServeOptions(port=0, api_key="k3y")).start()
    yield srv
    srv.stop()


async def test_page_and_cache_view_are_public_the_api_is_not(http: aiohttp.ClientSession,
                                                             keyed_server: ServerThread) -> None:
    async with http.get(keyed_server.url("/")) as r:
        assert r.status == 200 and r.content_type == "text/html"
        assert "default-src 'self'" in r.headers["Content-Security-Policy"]
        page = await r.text()
    assert '<canvas id="heatmap"' in page and "/web/app.js" in page
    for name in ("app.js", "chat.js", "sse.js", "heatmap.js", "chart.js", "feed.js", "style.css"):
        async with http.get(keyed_server.url(f"/web/{name}")) as r:
            assert r.status == 200, name
    assert (await get_state(http, keyed_server.url(STATE)))["layers"] == 2
    async with http.get(keyed_server.url(EVENTS)) as r:
        assert r.status == 200 and len(await asyncio.wait_for(read_state_events(r, 1), 10)) == 1
    async with http.get(keyed_server.url("/v1/models")) as r:
        assert r.status == 401
    for raw in ("/web/../v1/models", "/web/%2E%2E/v1/models"):
        async with http.get(URL(keyed_server.url(raw), encoded=True)) as r:
            assert r.status == 404, raw  # a public prefix never leads out of the static folder
    async with http.get(keyed_server.url("/web/missing.js")) as r:
        assert r.status == 404


async def test_a_split_model_reports_each_devices_cache(http: aiohttp.ClientSession, tiny_gguf: Path) -> None:
    """Two fake devices (the CPU named twice), a layer each: the state and /metrics give each device's part."""
    config = engine_config(tiny_gguf, cached=True)
    config = replace(config, model=replace(config.model, device="auto", devices="cpu,cpu"))
    srv = ServerThread(config, ServeOptions(port=0)).start()
    try:
        async with http.post(srv.url("/v1/completions"), json=greedy(max_tokens=6, prompt="hello there")) as r:
            assert r.status == 200
        stats = (await get_state(http, srv.url(STATE)))["stats"]
        async with http.get(srv.url("/metrics")) as r:
            families = {f.name: f for f in text_string_to_metric_families(await r.text())}
    finally:
        srv.stop()
    devices = stats["devices"]
    assert [d["device"] for d in devices] == ["cpu#0", "cpu#1"]
    assert sum(d["slots"] for d in devices) == stats["slots"] and all(d["slots"] > 0 for d in devices)
    assert sum(d["hits"] + d["misses"] for d in devices) == stats["hits"] + stats["misses"] > 0
    assert {g["device"] for g in stats["groups"]} == {"cpu#0", "cpu#1"}
    slots = {s.labels["device"]: s.value for s in families["moecache_expert_cache_slots"].samples}
    assert slots == {d["device"]: d["slots"] for d in devices}
    assert {s.labels["device"] for s in families["moecache_expert_cache_hits"].samples} == {"cpu#0", "cpu#1"}
