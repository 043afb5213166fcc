"""`/v1/jobs`: generation that runs in the background and outlives the connection.

`POST /v1/jobs` takes a completion or a chat request body and answers 202 with the queued job;
`GET /v1/jobs/{id}/events` streams the job's output from the start as server-sent events
(`id: <seq>`, resumable with `Last-Event-ID`), then one `event: done` with the finished job.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from service.http.errors import bad_request, read_json
from service.http.sse import HEADERS
from service.http.state import app_state
from service.jobs.api import job_object
from service.jobs.runtime import Jobs
from service.jobs.store import Job, JobEvent

DEFAULT_PAGE = 20


def jobs_of(request: web.Request) -> Jobs:
    jobs = app_state(request).jobs
    assert jobs is not None  # the routes exist only with jobs
    return jobs


async def submit_job(request: web.Request) -> web.Response:
    job = await jobs_of(request).submit(await read_json(request))
    return web.json_response(job_object(job), status=202)


async def get_job(request: web.Request) -> web.Response:
    return web.json_response(job_object(await jobs_of(request).get(request.match_info["job_id"])))


async def cancel_job(request: web.Request) -> web.Response:
    return web.json_response(job_object(await jobs_of(request).cancel(request.match_info["job_id"])))


async def list_jobs(request: web.Request) -> web.Response:
    query = request.query
    page, has_more = await jobs_of(request).list(query_int(request, "limit", DEFAULT_PAGE), query.get("after"),
                                                 query.get("status"))
    return web.json_response(page_object([job_object(job) for job in page], has_more))


def page_object(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": has_more}


def query_int(request: web.Request, name: str, default: int) -> int:
    value = request.query.get(name)
    if value is None:
        return default
    if not value.isdigit():
        raise bad_request(f"{name} must be a non-negative integer (got {value!r})", name)
    return int(value)


def resume_after(request: web.Request) -> int:
    """The last chunk the client has: `Last-Event-ID` (an SSE reconnect), else `?after=`, else 0."""
    given = request.headers.get("Last-Event-ID")
    if given is None:
        return query_int(request, "after", 0)
    if not given.isdigit():
        raise bad_request(f"Last-Event-ID must be a chunk number (got {given!r})", "Last-Event-ID")
    return int(given)


async def job_events(request: web.Request) -> web.StreamResponse:
    jobs, job_id = jobs_of(request), request.match_info["job_id"]
    after = resume_after(request)
    await jobs.get(job_id)  # 404 before the stream starts
    response = web.StreamResponse(headers=HEADERS)
    await response.prepare(request)
    try:
        async for item in jobs.watch(job_id, after):
            await response.write(sse_event(item))
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client went away; the job goes on
    return response


def sse_event(item: JobEvent | Job) -> bytes:
    if isinstance(item, Job):
        return f"event: done\ndata: {_json(job_object(item))}\n\n".encode()
    chunk = {"seq": item.seq, "text": item.text, "token_ids": list(item.token_ids)}
    return f"id: {item.seq}\ndata: {_json(chunk)}\n\n".encode()


def _json(payload: dict[str, Any]) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/jobs", submit_job),
        web.get("/v1/jobs", list_jobs),
        web.get("/v1/jobs/{job_id}", get_job),
        web.delete("/v1/jobs/{job_id}", cancel_job),
        web.get("/v1/jobs/{job_id}/events", job_events),
    ]
