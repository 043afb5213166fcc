"""What the handlers of one server share, stored on the aiohttp application."""

from __future__ import annotations

from aiohttp import web

from service.jobs.runtime import Jobs
from service.state import ServerState

STATE = web.AppKey("state", ServerState)
JOBS = web.AppKey("jobs", Jobs)


def app_state(request: web.Request) -> ServerState:
    return request.app[STATE]


def jobs_of(request: web.Request) -> Jobs:
    """Only in the handlers of the job, file and batch routes, which exist only with jobs."""
    return request.app[JOBS]
