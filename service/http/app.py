"""The aiohttp application: middlewares (errors, auth, readiness) and the route table."""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from service.http import batches, cache_view, completions, info, page
from service.http import jobs as job_routes
from service.http.auth import auth_middleware, is_public
from service.http.errors import error_middleware
from service.http.state import JOBS, STATE, app_state
from service.jobs.runtime import Jobs
from service.openai.errors import ApiError
from service.state import ServerState, engine_status


@web.middleware
async def readiness_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """503 for the API while the model loads, after the engine failed, and while draining."""
    if not is_public(request.path):
        status, why = engine_status(app_state(request))
        if status != "ok":
            raise ApiError(503, why, code=status)
    return await handler(request)


def build_app(state: ServerState, jobs: Jobs | None = None) -> web.Application:
    """The HTTP API of one server; the job, file and batch routes only with `jobs`."""
    middlewares: list[Middleware] = [error_middleware]
    if state.api_key:
        middlewares.append(auth_middleware(state.api_key))
    middlewares.append(readiness_middleware)
    app = web.Application(middlewares=middlewares, client_max_size=state.limits.max_body_bytes)
    app[STATE] = state
    app.add_routes([
        web.post("/v1/completions", completions.completions),
        web.post("/v1/chat/completions", completions.chat_completions),
        web.get("/v1/models", info.list_models),
        web.get("/v1/models/{model}", info.get_model),
        web.post("/tokenize", info.tokenize),
        web.post("/detokenize", info.detokenize),
        web.get("/health", info.health),
        web.get("/version", info.version),
        web.get("/metrics", info.metrics),
        web.get("/v1/cache/state", cache_view.get_cache_state),
        web.get("/v1/cache/events", cache_view.cache_events),
        *page.routes(),
    ])
    cache_view.setup(app, state.limits.max_cache_listeners)
    if jobs is not None:
        app[JOBS] = jobs
        app.add_routes([*job_routes.routes(), *batches.routes()])
    return app
