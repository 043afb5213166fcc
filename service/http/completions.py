"""`POST /v1/completions` and `POST /v1/chat/completions`: parse, take a turn, open the engine stream,
then answer with one JSON object or with server-sent events. Leaving the `open` block for any reason
(a client that went away cancels the handler) aborts what has not finished."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

from aiohttp import web

from engine.async_engine import EngineUnavailableError, RequestStream
from engine.gguf.tokenizer import Tokenizer
from engine.types import RequestOutput
from service.http.errors import read_json
from service.http.sse import EventStream
from service.http.state import app_state
from service.openai.errors import ApiError
from service.openai.kinds import Kind
from service.openai.requests import Generation, read_generation
from service.openai.responses import ChatFormat, Choice, CompletionFormat, Envelope, Format, JsonObject, usage
from service.state import ServerState


async def completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, "chat")


async def generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    arrival = time.perf_counter()
    state, body = app_state(request), await read_json(request)
    job = await asyncio.to_thread(read_generation, kind, body, state.model)
    return await respond(request, state, job, response_format(kind, state.tokenizer, job), arrival)


def response_format(kind: Kind, tokenizer: Tokenizer, job: Generation) -> Format:
    if kind == "chat":
        return ChatFormat(tokenizer, job.params.logprobs is not None)
    return CompletionFormat.for_job(tokenizer, job)


async def respond(request: web.Request, state: ServerState, job: Generation, fmt: Format,
                  arrival: float) -> web.StreamResponse:
    env = Envelope(f"{fmt.id_prefix}-{uuid.uuid4().hex}", int(time.time()), state.model_name, state.fingerprint)
    async with state.admission.turn(), state.engine.open(job.requests(env.id, arrival)) as stream:
        if job.stream:
            return await stream_response(request, stream, job, fmt, env)
        return web.json_response(await collect(stream, job, fmt, env))


def choice_index(request_id: str) -> int:
    return int(request_id.rsplit("-", 1)[1])


def job_usage(job: Generation, choices: list[Choice]) -> JsonObject:
    # Each prompt counts once, however many choices sample it (as OpenAI counts n > 1).
    return usage(sum(len(p) for p in job.prompts), sum(c.num_generated_tokens for c in choices))


def generation_failed(error: EngineUnavailableError) -> ApiError:
    return ApiError(500, f"generation failed: {error}", code="engine_error")


async def collect(stream: RequestStream, job: Generation, fmt: Format, env: Envelope) -> JsonObject:
    choices = [Choice(i) for i in range(job.num_choices)]
    try:
        async for out in stream:
            choices[choice_index(out.request_id)].add(out)
    except EngineUnavailableError as error:
        raise generation_failed(error) from None
    return env.wrap(fmt.object, choices=[fmt.choice(c) for c in choices], usage=job_usage(job, choices))


async def stream_response(request: web.Request, stream: RequestStream, job: Generation, fmt: Format,
                          env: Envelope) -> web.StreamResponse:
    events = EventStream()
    extra = {"usage": None} if job.include_usage else {}

    def chunk(delta: JsonObject) -> JsonObject:
        return env.wrap(fmt.chunk_object, choices=[delta], **extra)

    # NOTE: a client that went away ends the block; leaving the engine's `open` then aborts its requests.
    async with events.open(request):
        if await send_choices(events, stream, job, fmt, chunk, env):
            await events.done()
    return events.response


async def send_choices(events: EventStream, stream: RequestStream, job: Generation, fmt: Format,
                       chunk: Callable[[JsonObject], JsonObject], env: Envelope) -> bool:
    """Every chunk of the choices; False when the engine failed (the stream ended with an error event)."""
    choices = [Choice(i) for i in range(job.num_choices)]
    for c in choices:
        if (first := fmt.first_delta(c.index)) is not None:
            await events.send(chunk(first))
    try:
        async for out in stream:
            await send_output(events, choices[choice_index(out.request_id)], out, fmt, chunk)
    except EngineUnavailableError as error:
        await events.fail(generation_failed(error))
        return False
    if job.include_usage:
        await events.send(env.wrap(fmt.chunk_object, choices=[], usage=job_usage(job, choices)))
    return True


async def send_output(events: EventStream, choice: Choice, out: RequestOutput, fmt: Format,
                      chunk: Callable[[JsonObject], JsonObject]) -> None:
    choice.add(out)
    if out.new_text or out.logprobs:
        await events.send(chunk(fmt.delta(choice.index, out.new_text, out.logprobs, out.prompt_logprobs)))
    if out.finished:
        await events.send(chunk(fmt.finish(choice.index, out.finish_reason or "abort")))
