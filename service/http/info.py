"""The small endpoints: models, tokenize, detokenize, health, version, metrics."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from service.http.errors import read_json
from service.http.state import app_state
from service.openai.body import Body
from service.openai.errors import ApiError, bad_request
from service.openai.requests import tokenize_request
from service.state import ServerState, engine_status


def model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "moecache",
            "max_model_len": state.engine.max_model_len}


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [model_card(app_state(request))]})


async def get_model(request: web.Request) -> web.Response:
    state, name = app_state(request), request.match_info["model"]
    if name != state.model_name:
        raise ApiError(404, f"the model {name[:100]!r} does not exist", "model", "model_not_found")
    return web.json_response(model_card(state))


async def tokenize(request: web.Request) -> web.Response:
    state, body = app_state(request), await read_json(request)
    tokens = await asyncio.to_thread(tokenize_request, body, state.tokenizer)
    return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": state.engine.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    state, body = app_state(request), Body(await read_json(request))
    tokens = body.raw("tokens")
    tok = state.tokenizer
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("tokens must be a list of token ids", "tokens")
    if any(not 0 <= t < tok.vocab_size for t in tokens):
        raise bad_request(f"token ids must be in [0, {tok.vocab_size})", "tokens")
    return web.json_response({"prompt": await asyncio.to_thread(tok.decode, tokens)})


async def health(request: web.Request) -> web.Response:
    status, why = engine_status(app_state(request))
    if status == "ok":
        return web.json_response({"status": status})
    body = ApiError(503, why, code=status).body()
    return web.json_response({"status": status, **body}, status=503)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": app_state(request).version})


async def metrics(request: web.Request) -> web.Response:
    # in a thread: collecting counts jobs in the job store, which may be a database over the network
    body, content_type = await asyncio.to_thread(app_state(request).metrics.render)
    return web.Response(body=body, headers={"Content-Type": content_type})
