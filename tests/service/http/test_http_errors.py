"""Every error status as OpenAI's error object, over raw HTTP: 400, 401, 404, 413, 429, 503; auth."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from http_servers import MODEL, ServerThread, engine_config, greedy, wait_until

from engine.llm_engine import LLMEngine
from service.openai.limits import Limits
from service.server import ServeOptions

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


async def post(http: aiohttp.ClientSession, url: str, body: Any = None, data: bytes | None = None,
               headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    async with http.post(url, json=body, data=data, headers=headers) as r:
        return r.status, await r.json()


def assert_error(status: int, body: dict[str, Any], expected: int, param: str | None = None,
                 code: str | None = None) -> dict[str, Any]:
    assert status == expected, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert error["param"] == param and (code is None or error["code"] == code)
    return error


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d"]}, "stop"),
    ({"prompt": "hi", "stop": [""]}, "stop"),
    ({"prompt": "hi", "n": 5}, "n"),
    ({"prompt": "hi", "max_tokens": 201}, "max_tokens"),
    ({"prompt": "hi", "echo": "yes"}, "echo"),
    ({"prompt": "hi", "user": 5}, "user"),
    ({"prompt": "hi", "seed": -1}, "seed"),
    ({"prompt": "hi", "stream_options": {"include_usage": "yes"}}, "include_usage"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [10**8]}, "prompt"),
])
async def test_invalid_completion_fields_are_400_naming_the_field(
        http: aiohttp.ClientSession, server: ServerThread, body: dict[str, Any], param: str) -> None:
    error = assert_error(*await post(http, server.url(COMPLETIONS), {"model": MODEL, **body}), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
])
async def test_invalid_chat_fields_are_400(http: aiohttp.ClientSession, server: ServerThread,
                                           body: dict[str, Any], param: str) -> None:
    assert_error(*await post(http, server.url(CHAT), {"model": MODEL, **body}), 400, param)


async def test_bad_json_and_non_object_bodies_are_400(http: aiohttp.ClientSession, server: ServerThread) -> None:
    assert "JSON" in assert_error(*await post(http, server.url(COMPLETIONS), data=b"{nope"), 400)["message"]
    assert_error(*await post(http, server.url(COMPLETIONS), [1, 2]), 400)


async def test_context_overflow_is_400_with_the_numbers(http: aiohttp.ClientSession, server: ServerThread) -> None:
    body = greedy(max_tokens=200, prompt="word " * 100)
    error = assert_error(*await post(http, server.url(COMPLETIONS), body), 400, "max_tokens",
                         "context_length_exceeded")
    assert "256" in error["message"] and "200" in error["message"]


async def test_unknown_model_and_route_are_404(http: aiohttp.ClientSession, server: ServerThread) -> None:
    body = {"model": "gpt-9", "prompt": "hi"}
    assert_error(*await post(http, server.url(COMPLETIONS), body), 404, "model", "model_not_found")
    async with http.get(server.url("/v1/models/gpt-9")) as r:
        assert_error(r.status, await r.json(), 404, "model", "model_not_found")
    async with http.get(server.url("/v2/nothing")) as r:
        assert_error(r.status, await r.json(), 404)
    async with http.get(server.url(COMPLETIONS)) as r:
        assert_error(r.status, await r.json(), 405)


async def test_body_too_large_is_413(http: aiohttp.ClientSession, server: ServerThread) -> None:
    body = {"model": MODEL, "prompt": "x" * (65 * 1024)}
    assert_error(*await post(http, server.url(COMPLETIONS), body), 413, code="request_too_large")
    async with http.get(server.url("/health")) as r:
        assert r.status == 200


async def test_streaming_request_errors_come_before_the_stream(http: aiohttp.ClientSession,
                                                               server: ServerThread) -> None:
    body = greedy(max_tokens=199, prompt="w " * 100, stream=True)
    async with http.post(server.url(COMPLETIONS), json=body) as r:
        assert r.status == 400 and r.content_type == "application/json"
        assert (await r.json())["error"]["code"] == "context_length_exceeded"


@pytest.fixture(scope="module")
def keyed_server(tiny_gguf: Path) -> Iterator[ServerThread]:
    srv = ServerThread(engine_config(tiny_gguf), ServeOptions(port=0, api_key="s3cret")).start()
    yield srv
    srv.stop()


async def test_api_key_is_required_except_on_public_endpoints(http: aiohttp.ClientSession,
                                                              keyed_server: ServerThread) -> None:
    url = keyed_server.url(COMPLETIONS)
    body = greedy(max_tokens=2, prompt="hi")
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        error = assert_error(*await post(http, url, body, headers=headers), 401, code="invalid_api_key")
        assert error["type"] == "authentication_error"
    status, out = await post(http, url, body, headers={"Authorization": "Bearer s3cret"})
    assert status == 200 and out["choices"][0]["finish_reason"] == "length"
    async with http.get(keyed_server.url("/v1/models")) as r:
        assert r.status == 401
    for path in ("/health", "/metrics", "/version"):
        async with http.get(keyed_server.url(path)) as r:
            assert r.status == 200, path


async def test_over_the_concurrency_and_queue_limits_is_429(http: aiohttp.ClientSession, tiny_gguf: Path) -> None:
    limits = Limits(max_concurrent_requests=1, max_queued_requests=1)
    srv = ServerThread(engine_config(tiny_gguf), ServeOptions(port=0, limits=limits)).start()
    try:
        running = asyncio.create_task(post(http, srv.url(COMPLETIONS), greedy(max_tokens=200, prompt="a")))
        await wait_until(lambda: srv.server.admission.num_running == 1)
        queued = asyncio.create_task(post(http, srv.url(COMPLETIONS), greedy(max_tokens=2, prompt="b")))
        await wait_until(lambda: srv.server.admission.num_queued == 1)
        error = assert_error(*await post(http, srv.url(COMPLETIONS), greedy(prompt="c")), 429,
                             code="too_many_requests")
        assert error["type"] == "rate_limit_error"
        assert [s for s, _ in await asyncio.gather(running, queued)] == [200, 200]
    finally:
        srv.stop()


async def test_health_and_api_are_503_while_loading(http: aiohttp.ClientSession, tiny_gguf: Path) -> None:
    release = threading.Event()

    def held_progress(label: str, done: int, total: int) -> None:
        release.wait(30)  # the load pauses here until the test has seen the 503s

    srv = ServerThread(engine_config(tiny_gguf), progress=held_progress).start(wait_ready=False)
    try:
        srv.wait_bound()
        async with http.get(srv.url("/health")) as r:
            body = await r.json()
            assert r.status == 503 and body["status"] == "loading"
        error = assert_error(*await post(http, srv.url(COMPLETIONS), greedy(prompt="hi")), 503)
        assert "loading" in error["message"]
        release.set()
        await wait_until(lambda: srv.engine.is_ready)
        async with http.get(srv.url("/health")) as r:
            assert r.status == 200
    finally:
        release.set()
        srv.stop()


async def test_engine_failure_mid_stream_ends_the_stream_with_an_error_event(
        http: aiohttp.ClientSession, tiny_gguf: Path) -> None:
    llm = LLMEngine(engine_config(tiny_gguf))
    forward, calls = llm.model.forward, [0]

    def failing_forward(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] > 4:
            raise RuntimeError("device lost")
        return forward(*args, **kwargs)

    llm.model.forward = failing_forward  # type: ignore[method-assign]
    srv = ServerThread(llm.config, engine=llm).start()
    try:
        async with http.post(srv.url(COMPLETIONS), json=greedy(max_tokens=50, prompt="hi", stream=True)) as r:
            text = (await r.read()).decode()
        blocks = text.strip().split("\n\n")
        assert blocks[-1].startswith("event: error\ndata: ") and "[DONE]" not in text
        assert "device lost" in json.loads(blocks[-1].split("data: ", 1)[1])["error"]["message"]
        assert all("choices" in json.loads(b.removeprefix("data: ")) for b in blocks[:-1]) and len(blocks) >= 3
        async with http.get(srv.url("/health")) as r:
            assert r.status == 503 and (await r.json())["status"] == "dead"
        assert_error(*await post(http, srv.url(COMPLETIONS), greedy(prompt="hi")), 503)
    finally:
        srv.stop()
