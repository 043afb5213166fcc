"""Streams under load and clients that go away: disconnects abort within a step or two, 32 concurrent
streams with a third aborted, and the Prometheus exposition."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from http_servers import MODEL, ServerThread, greedy, read_events, wait_until
from prometheus_client.parser import text_string_to_metric_families

COMPLETIONS = "/v1/completions"
PROMPTS = ["Once upon a time", "The capital of", "1 2 3 4", "In the beginning"]

COUNTERS = [
    "moecache_expert_cache_hits", "moecache_expert_cache_misses", "moecache_expert_upload_bytes",
    "moecache_expert_stream_bytes", "moecache_expert_cpu_computed", "moecache_expert_cache_promotions",
    "moecache_expert_cache_evictions", "moecache_prompt_tokens", "moecache_generation_tokens",
    "moecache_request_success",
]
GAUGES = [
    "moecache_expert_cache_hit_ratio", "moecache_expert_cache_bytes", "moecache_expert_cache_slots",
    "moecache_decode_tokens_per_second", "moecache_requests_running", "moecache_requests_waiting",
    "moecache_kv_cache_usage_ratio",
]
HISTOGRAMS = [
    "moecache_time_to_first_token_seconds", "moecache_inter_token_latency_seconds",
    "moecache_e2e_request_latency_seconds", "moecache_request_queue_time_seconds",
]


async def scrape(http: aiohttp.ClientSession, server: ServerThread) -> dict[str, Any]:
    """Family name -> family, from the text exposition."""
    async with http.get(server.url("/metrics")) as r:
        assert r.status == 200 and r.content_type == "text/plain"
        return {f.name: f for f in text_string_to_metric_families(await r.text())}


def value(families: dict[str, Any], name: str, **labels: str) -> float:
    family = families[name]
    return sum(s.value for s in family.samples
               if s.name in (name, f"{name}_total") and all(s.labels.get(k) == v for k, v in labels.items()))


async def raw_request(server: ServerThread, body: dict[str, Any]) -> tuple[asyncio.StreamReader,
                                                                            asyncio.StreamWriter]:
    """A POST written on a plain socket, so the test can drop the connection whenever it likes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.server.port)
    data = json.dumps(body).encode()
    writer.write(f"POST {COMPLETIONS} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    return reader, writer


async def test_metrics_names_labels_and_engine_totals(http: aiohttp.ClientSession, server: ServerThread) -> None:
    before = await scrape(http, server)
    async with http.post(server.url(COMPLETIONS), json=greedy(max_tokens=5, prompt="Hello there")) as r:
        usage = (await r.json())["usage"]
    after = await scrape(http, server)
    assert {f.type for n, f in after.items() if n in COUNTERS} == {"counter"}
    assert {f.type for n, f in after.items() if n in GAUGES} == {"gauge"}
    assert {f.type for n, f in after.items() if n in HISTOGRAMS} == {"histogram"}
    assert set(COUNTERS + GAUGES + HISTOGRAMS) <= set(after)
    moecache = [s for n, f in after.items() if n.startswith("moecache_") for s in f.samples]
    assert all(s.labels.get("model") == MODEL for s in moecache)
    for name, key in (("moecache_prompt_tokens", "prompt_tokens"), ("moecache_generation_tokens",
                                                                    "completion_tokens")):
        assert value(after, name) - value(before, name) == usage[key]
    assert value(after, "moecache_generation_tokens") == server.engine.stats().stats.generation_tokens
    assert value(after, "moecache_expert_cache_hits") + value(after, "moecache_expert_cache_misses") > 0
    assert {s.labels["batch_class"] for s in after["moecache_expert_cache_hits"].samples} <= {"<=8", "9-32", ">32"}
    assert value(after, "moecache_expert_cache_slots") > 0
    success = value(after, "moecache_request_success", finished_reason="length")
    assert success - value(before, "moecache_request_success", finished_reason="length") == 1
    ttft = [s for s in after["moecache_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert ttft[0].value >= 1


async def test_streaming_client_that_disconnects_is_aborted_within_steps(
        http: aiohttp.ClientSession, server: ServerThread) -> None:
    reader, writer = await raw_request(server, greedy(max_tokens=200, prompt="Hello", stream=True))
    events = 0
    while events < 2:  # two events: the request is decoding (lines also hold chunk sizes and headers)
        events += (await reader.readline()).startswith(b"data:")
    steps = server.engine.stats().stats.steps
    writer.close()
    await wait_until(lambda: server.engine.num_pending == 0 and server.engine.num_running == 0)
    assert server.engine.stats().stats.steps - steps <= 2  # the abort lands within a step or two
    families = await scrape(http, server)
    assert value(families, "moecache_requests_running") == 0
    assert value(families, "moecache_request_success", finished_reason="abort") >= 1


async def test_non_streaming_client_that_disconnects_is_aborted(http: aiohttp.ClientSession,
                                                                server: ServerThread) -> None:
    aborted = value(await scrape(http, server), "moecache_request_success", finished_reason="abort")
    generated = server.engine.stats().stats.generation_tokens
    _, writer = await raw_request(server, greedy(max_tokens=200, prompt="Hello"))
    await wait_until(lambda: server.engine.num_running == 1)
    writer.close()
    await wait_until(lambda: server.engine.num_pending == 0 and server.engine.num_running == 0)
    families = await scrape(http, server)
    assert value(families, "moecache_request_success", finished_reason="abort") == aborted + 1
    assert value(families, "moecache_generation_tokens") - generated < 200


async def stream_client(http: aiohttp.ClientSession, server: ServerThread, prompt: str,
                        abort_after: int | None) -> list[Any] | None:
    """A streaming client; `abort_after`: drop the connection after that many events."""
    async with http.post(server.url(COMPLETIONS), json=greedy(max_tokens=12, prompt=prompt, stream=True)) as r:
        if abort_after is None:
            return await read_events(r)
        seen = 0
        async for line in r.content:
            seen += line.startswith(b"data:")
            if seen == abort_after:
                r.close()  # drops the connection mid-stream
                return None
    raise AssertionError("the stream ended before the client dropped it")


async def test_32_concurrent_streams_with_a_third_aborted(http: aiohttp.ClientSession,
                                                          server: ServerThread) -> None:
    expected = {}
    for prompt in PROMPTS:
        async with http.post(server.url(COMPLETIONS), json=greedy(max_tokens=12, prompt=prompt)) as r:
            expected[prompt] = (await r.json())["choices"][0]["text"]
    clients = [stream_client(http, server, PROMPTS[i % 4], 3 if i % 3 == 0 else None) for i in range(32)]
    results = await asyncio.gather(*clients)
    completed = [(i, events) for i, events in enumerate(results) if events is not None]
    assert len(completed) == 32 - 11
    for i, events in completed:
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
        assert not any(c["choices"][0]["finish_reason"] for c in chunks[:-1])
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected[PROMPTS[i % 4]]
    await wait_until(lambda: server.engine.num_pending == 0)
    families = await scrape(http, server)
    assert value(families, "moecache_requests_running") == 0
    assert value(families, "moecache_requests_waiting") == 0
