"""`/v1/jobs` over raw HTTP against a real server, on SQLite and on PostgreSQL: submit, result, SSE
events from the start and resumed, cancel (running and queued), list, and the errors."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from job_servers import ServerThread, get_json, greedy, poll, wait_job

JsonObject = dict[str, Any]


async def submit(http: aiohttp.ClientSession, server: ServerThread, body: JsonObject) -> JsonObject:
    async with http.post(server.url("/v1/jobs"), json=body) as r:
        assert r.status == 202, await r.text()
        job: JsonObject = await r.json()
        return job


async def read_sse(response: aiohttp.ClientResponse) -> list[tuple[str | None, str, JsonObject]]:
    """(id, event type, data) of every event until the server ends the stream."""
    events, fields = [], {}
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if not line:
            events.append((fields.get("id"), fields.get("event", "message"), json.loads(fields["data"])))
            fields = {}
        else:
            name, _, value = line.partition(": ")
            fields[name] = value
    return events


async def events_of(http: aiohttp.ClientSession, server: ServerThread, job_id: str,
                    headers: dict[str, str] | None = None, query: str = "") -> list[tuple[str | None, str, JsonObject]]:
    async with http.get(server.url(f"/v1/jobs/{job_id}/events{query}"), headers=headers) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        return await read_sse(r)


async def test_a_completion_job_runs_in_the_background_and_keeps_its_result(
        http: aiohttp.ClientSession, server: ServerThread) -> None:
    queued = await submit(http, server, greedy(8, prompt="Once upon a time"))
    assert queued["status"] == "queued" and queued["object"] == "job" and queued["id"].startswith("job_")
    job = await wait_job(http, server.base_url, queued["id"])
    assert job["status"] == "succeeded" and job["progress_tokens"] == 8 and job["attempts"] == 1
    assert job["created_at"] <= job["started_at"] <= job["finished_at"]
    result = job["result"]
    assert result["object"] == "text_completion" and result["model"] == "tiny"
    assert result["choices"][0]["text"] == job["text"] and result["choices"][0]["finish_reason"] == "length"
    prompt_tokens = len(server.engine.tokenizer.encode("Once upon a time"))
    assert result["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 8,
                               "total_tokens": prompt_tokens + 8}


async def test_a_chat_job_has_a_chat_completion_result(http: aiohttp.ClientSession, server: ServerThread) -> None:
    queued = await submit(http, server, greedy(5, messages=[{"role": "user", "content": "Hi"}]))
    job = await wait_job(http, server.base_url, queued["id"])
    assert job["kind"] == "chat" and job["status"] == "succeeded"
    choice = job["result"]["choices"][0]
    assert job["result"]["object"] == "chat.completion"
    assert choice["message"] == {"role": "assistant", "content": job["text"], "refusal": None}


async def test_events_stream_from_the_start_and_resume_after_an_id(http: aiohttp.ClientSession,
                                                                   server: ServerThread) -> None:
    # NOTE: tokens that arrive while the worker persists its last chunk go in its next one: enough tokens that the
    # job's events are several chunks however fast the engine runs beside the store
    queued = await submit(http, server, greedy(120, prompt="The river"))
    events = await events_of(http, server, queued["id"])  # opened while the job is queued or running
    chunks, (_, kind, done) = events[:-1], events[-1]
    assert kind == "done" and done["status"] == "succeeded" and done["id"] == queued["id"]
    assert [c[2]["seq"] for c in chunks] == list(range(1, len(chunks) + 1)) and len(chunks) >= 3
    assert [c[0] for c in chunks] == [str(c[2]["seq"]) for c in chunks]
    assert "".join(c[2]["text"] for c in chunks) == done["text"] == done["result"]["choices"][0]["text"]
    assert sum(len(c[2]["token_ids"]) for c in chunks) == 120
    resumed = await events_of(http, server, queued["id"], headers={"Last-Event-ID": "2"})
    assert resumed == events[2:]
    assert await events_of(http, server, queued["id"], query="?after=1") == events[1:]


async def test_cancel_stops_a_running_job_and_ends_a_queued_one(http: aiohttp.ClientSession,
                                                                 server: ServerThread) -> None:
    first, second = [await submit(http, server, greedy(200, prompt=p)) for p in ("one", "two")]
    await wait_job(http, server.base_url, first["id"], until=lambda j: j["progress_tokens"] > 0)
    third = await submit(http, server, greedy(200, prompt="three"))  # both turns are taken: it waits
    async with http.delete(server.url(f"/v1/jobs/{third['id']}")) as r:
        assert r.status == 200 and (await r.json())["status"] == "cancelled"
    for job in (first, second):
        async with http.delete(server.url(f"/v1/jobs/{job['id']}")) as r:
            assert r.status == 200 and (await r.json())["cancel_requested"]
    for job in (first, second, third):
        done = await wait_job(http, server.base_url, job["id"], timeout=10)
        assert done["status"] == "cancelled" and done["result"] is None and done["progress_tokens"] < 200
    await poll(lambda: _value(server.engine.num_pending == 0), timeout=5)
    async with http.delete(server.url(f"/v1/jobs/{first['id']}")) as r:  # finished: unchanged
        assert (await r.json())["status"] == "cancelled"


async def _value(value: bool) -> bool:
    return value


async def test_list_pages_newest_first_and_filters_by_status(http: aiohttp.ClientSession,
                                                             server: ServerThread) -> None:
    submitted = [await submit(http, server, greedy(2, prompt=f"p{i}")) for i in range(3)]
    for job in submitted:
        await wait_job(http, server.base_url, job["id"])
    page = await get_json(http, server.url("/v1/jobs?limit=2"))
    assert [j["id"] for j in page["data"]] == [submitted[2]["id"], submitted[1]["id"]] and page["has_more"]
    assert page["object"] == "list" and page["last_id"] == submitted[1]["id"]
    after = await get_json(http, server.url(f"/v1/jobs?limit=1&after={page['last_id']}"))
    assert [j["id"] for j in after["data"]] == [submitted[0]["id"]]
    succeeded = await get_json(http, server.url("/v1/jobs?status=succeeded&limit=100"))
    assert {j["id"] for j in submitted} <= {j["id"] for j in succeeded["data"]}
    assert all(j["status"] == "succeeded" for j in succeeded["data"])


@pytest.mark.parametrize(("body", "status", "param"), [
    (greedy(4, prompt="x", temperature=-1), 400, "temperature"),
    (greedy(4, prompt="x", stream=True), 400, "stream"),
    (greedy(4, prompt="x", n=2), 400, "n"),
    (greedy(4, prompt=["a", "b"]), 400, "n"),
    (greedy(4, prompt="x", logprobs=2), 400, "logprobs"),
    (greedy(4, prompt="x", prompt_logprobs=2), 400, "logprobs"),
    (greedy(4, prompt="x", echo=True), 400, "echo"),
    (greedy(201, prompt="x"), 400, "max_tokens"),
    (greedy(4, messages=[]), 400, "messages"),
    ({**greedy(4, prompt="x"), "model": "gpt-4"}, 404, "model"),
])
async def test_a_bad_job_is_refused_as_the_endpoint_refuses_it(http: aiohttp.ClientSession, server: ServerThread,
                                                              body: JsonObject, status: int, param: str) -> None:
    async with http.post(server.url("/v1/jobs"), json=body) as r:
        error = (await r.json())["error"]
        assert r.status == status and error["param"] == param


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/jobs/job_missing"), ("DELETE", "/v1/jobs/job_missing"), ("GET", "/v1/jobs/job_missing/events")])
async def test_an_unknown_job_is_404(http: aiohttp.ClientSession, server: ServerThread, method: str,
                                     path: str) -> None:
    async with http.request(method, server.url(path)) as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"


@pytest.mark.parametrize("query", ["?status=done", "?limit=0", "?limit=101", "?limit=x"])
async def test_bad_list_parameters_are_400(http: aiohttp.ClientSession, server: ServerThread, query: str) -> None:
    async with http.get(server.url(f"/v1/jobs{query}")) as r:
        assert r.status == 400
