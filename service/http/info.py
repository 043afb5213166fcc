"""The small endpoints: models, tokenize, detokenize, health, version, metrics."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from service.http.errors import ApiError, bad_request, read_json
from service.http.params import Body, chat_messages
from service.http.state import AppState, app_state


def model_card(state: AppState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "moecache",
            "max_model_len": state.engine.max_model_len}


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [model_card(app_state(request))]})


async def get_model(request: web.Request) -> web.Response:
    state = app_state(request)
    if request.match_info["model"] != state.model_name:
        raise ApiError(404, f"the model {request.match_info['model']!r} does not exist", "model",
                       "model_not_found")
    return web.json_response(model_card(state))


def tokenize_body(body: Body, state: AppState) -> list[int]:
    """`{"prompt": str, "add_special"}` or `{"messages": [...], "add_generation_prompt"}`."""
    tok = state.tokenizer
    if body.raw("messages") is not None:
        try:
            return tok.encode_chat(chat_messages(body.raw("messages")), body.boolean("add_generation_prompt", True))
        except ValueError as error:
            raise bad_request(str(error), "messages") from None
    prompt = body.string("prompt")
    if prompt is None:
        raise bad_request("give prompt (a string) or messages", "prompt")
    return tok.encode(prompt, add_special=body.boolean("add_special", True))


async def tokenize(request: web.Request) -> web.Response:
    state, body = app_state(request), Body(await read_json(request))
    tokens = await asyncio.to_thread(tokenize_body, body, state)
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


def engine_status(state: AppState) -> tuple[str, str]:
    """(status, why) as /health reports it."""
    engine = state.engine
    if engine.is_dead:
        return "dead", "the engine stopped after an error"
    if not engine.is_ready:
        return "loading", "the model is still loading"
    if not engine.is_accepting:
        return "draining", "the server is shutting down"
    return "ok", ""


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
