"""The interceptor in front of every gRPC service: the API key and readiness for the moecache services
(health and reflection stay open, like `/health`), checked before any request message is parsed; and a
request message that does not parse is INVALID_ARGUMENT on every service (grpc.aio itself would answer
UNKNOWN, naming the parser's exception)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from service.openai.auth import is_authorized
from service.state import ServerState, engine_status

GUARDED_PREFIX = "/moecache."
HANDLER_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}
Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


class Gate(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED without the API key, UNAVAILABLE while the model loads or the server drains,
    INVALID_ARGUMENT for a request message that does not parse."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None:
            return None
        refusal = self._refusal(details) if details.method.startswith(GUARDED_PREFIX) else None
        return checked(handler) if refusal is None else refused(handler, *refusal)

    def _refusal(self, details: grpc.HandlerCallDetails) -> tuple[grpc.StatusCode, str] | None:
        api_key = self.state.api_key
        if api_key and not is_authorized(authorization(details), api_key):
            return grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key (metadata authorization: Bearer <key>)"
        status, why = engine_status(self.state)
        return None if status == "ok" else (grpc.StatusCode.UNAVAILABLE, why)


def authorization(details: grpc.HandlerCallDetails) -> str | bytes | None:
    for key, value in details.invocation_metadata or ():
        if key == "authorization":
            return value  # type: ignore[no-any-return]
    return None


def handler_kind(handler: grpc.RpcMethodHandler) -> str:
    return next(k for k in HANDLER_FACTORIES if getattr(handler, k) is not None)


def refused(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that ends the call with `code`, without parsing the request."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    return HANDLER_FACTORIES[handler_kind(handler)](refuse, request_deserializer=lambda raw: None,
                                                    response_serializer=handler.response_serializer)


class Malformed:
    """What a request message that does not parse becomes, so the handler can answer INVALID_ARGUMENT
    (grpc.aio would answer UNKNOWN, naming the parser's exception)."""

    def __init__(self, error: Exception) -> None:
        self.message = f"the request is not a valid message of this method: {str(error)[:200]}"


def checked(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with a request parser that cannot raise, and INVALID_ARGUMENT for what did not parse."""
    kind, parse = handler_kind(handler), handler.request_deserializer

    def safe_parse(raw: bytes) -> Any:
        try:
            return parse(raw) if parse is not None else raw
        except Exception as error:  # protobuf raises DecodeError; whatever a parser raises, the call gets a status
            return Malformed(error)

    behaviour = WRAPPERS[kind](getattr(handler, kind))
    return HANDLER_FACTORIES[kind](behaviour, request_deserializer=safe_parse,
                                   response_serializer=handler.response_serializer)


async def _reject(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


async def _requests(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async for request in requests:
        await _reject(request, context)
        yield request


def _unary_unary(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _reject(request, context)
        return await behaviour(request, context)
    return call


def _unary_stream(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _reject(request, context)
        async for response in behaviour(request, context):
            yield response
    return call


def _stream_unary(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def call(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return await behaviour(_requests(requests, context), context)
    return call


def _stream_stream(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    async def call(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for response in behaviour(_requests(requests, context), context):
            yield response
    return call


WRAPPERS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "unary_unary": _unary_unary, "unary_stream": _unary_stream,
    "stream_unary": _stream_unary, "stream_stream": _stream_stream,
}
