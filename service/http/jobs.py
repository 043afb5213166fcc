"""`/v1/jobs`: generation that runs in the background and outlives the connection.

`POST /v1/jobs` takes a completion or a chat request body and answers 202 with the queued job;
`GET /v1/jobs/{id}/events` streams the job's output from the start as server-sent events
(`id: <seq>`, resumable with `Last-Event-ID`), then one `event: done` with the finished job.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from service.http.errors import read_json
from service.http.sse import EventStream
from service.http.state import jobs_of
from service.jobs.api import DEFAULT_PAGE, MAX_PAGE, MAX_SEQ, job_object
from service.jobs.records import Job, JobEvent
from service.openai.body import parse_count


async def submit_job(request: web.Request) -> web.Response:
    job = await jobs_of(request).submit(await read_json(request))
    return web.json_response(job_object(job), status=202)


async def get_job(request: web.Request) -> web.Response:
    return web.json_response(job_object(await jobs_of(request).get(request.match_info["job_id"])))


async def cancel_job(request: web.Request) -> web.Response:
    return web.json_response(job_object(await jobs_of(request).cancel(request.match_info["job_id"])))


async def list_jobs(request: web.Request) -> web.Response:
    query = request.query
    page, has_more = await jobs_of(request).list(page_limit(request), query.get("after"), query.get("status"))
    return web.json_response(page_object([job_object(job) for job in page], has_more))


def page_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": has_more}


def page_limit(request: web.Request) -> int:
    """`?limit=`: 1 to MAX_PAGE, DEFAULT_PAGE when absent."""
    value = request.query.get("limit")
    return DEFAULT_PAGE if value is None else parse_count(value, "limit", MAX_PAGE, minimum=1)


def resume_after(request: web.Request) -> int:
    """The last chunk the client has: `Last-Event-ID` (an SSE reconnect), else `?after=`, else 0."""
    given = request.headers.get("Last-Event-ID")
    if given is not None:
        return parse_count(given.strip(), "Last-Event-ID", MAX_SEQ)
    after = request.query.get("after")
    return 0 if after is None else parse_count(after, "after", MAX_SEQ)


async def job_events(request: web.Request) -> web.StreamResponse:
    jobs, job_id = jobs_of(request), request.match_info["job_id"]
    after = resume_after(request)
    await jobs.get(job_id)  # 404 before the stream starts
    events = EventStream()
    async with events.open(request):  # a client that goes away leaves the job running
        async for item in jobs.watch(job_id, after):
            await send_item(events, item)
    return events.response


async def send_item(events: EventStream, item: JobEvent | Job) -> None:
    if isinstance(item, Job):
        await events.send(job_object(item), event="done")
    else:
        await events.send({"seq": item.seq, "text": item.text, "token_ids": list(item.token_ids)}, event_id=item.seq)


def routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/jobs", submit_job),
        web.get("/v1/jobs", list_jobs),
        web.get("/v1/jobs/{job_id}", get_job),
        web.delete("/v1/jobs/{job_id}", cancel_job),
        web.get("/v1/jobs/{job_id}/events", job_events),
    ]
