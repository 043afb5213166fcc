"""The gRPC server (`grpc.aio`), in the HTTP server's process and event loop, over the same AsyncEngine:
`moecache.v1.Generation`, `moecache.v1.Jobs` (with a job store), `grpc.health.v1.Health` (SERVING only
while the engine takes requests) and server reflection. One interceptor checks the API key and readiness
for the moecache services (health and reflection stay open, like `/health`), before any request message
is parsed; a message that does not parse is INVALID_ARGUMENT on every service."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.grpc_api.convert import STUBS, gen_pb, jobs_pb
from service.grpc_api.services import GenerationService, JobsService
from service.jobs.runtime import Jobs
from service.openai.auth import is_authorized
from service.state import ServerState, engine_status

log = logging.getLogger(__name__)

GUARDED_PREFIX = "/moecache."
HEALTH_WATCH_POLL_S = 0.25
GENERATION = gen_pb.DESCRIPTOR.services_by_name["Generation"].full_name
JOBS = jobs_pb.DESCRIPTOR.services_by_name["Jobs"].full_name
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


class Health(health_pb2_grpc.HealthServicer):
    """grpc.health.v1, answered from the engine's state at each call (never a stale flag)."""

    def __init__(self, state: ServerState, services: tuple[str, ...]) -> None:
        self.state, self.services = state, frozenset(("", *services))

    def status(self, service: str) -> int:
        if service not in self.services:
            return int(health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        is_serving = engine_status(self.state)[0] == "ok"
        return int(health_pb2.HealthCheckResponse.SERVING if is_serving else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        status = self.status(request.service)
        if status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        last = None
        while True:
            status = self.status(request.service)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(HEALTH_WATCH_POLL_S)


class GrpcServer:
    """Built and bound in `start()`, inside the event loop that serves it."""

    def __init__(self, state: ServerState, jobs: Jobs | None, host: str, port: int) -> None:
        self.state, self.jobs, self.host, self.requested_port = state, jobs, host, port
        self.port = 0  # the bound port once started
        self._server: grpc.aio.Server | None = None

    @property
    def services(self) -> tuple[str, ...]:
        return (GENERATION, JOBS) if self.jobs is not None else (GENERATION,)

    async def start(self) -> None:
        server = grpc.aio.server(interceptors=[Gate(self.state)])
        STUBS.generation_grpc.add_GenerationServicer_to_server(GenerationService(self.state), server)
        if self.jobs is not None:
            STUBS.jobs_grpc.add_JobsServicer_to_server(JobsService(self.jobs), server)
        health_pb2_grpc.add_HealthServicer_to_server(Health(self.state, self.services), server)
        reflection.enable_server_reflection((*self.services, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        self.port = self._bind(server)
        await server.start()
        self._server = server
        log.info("gRPC listening on %s:%d", self.host, self.port)

    def _bind(self, server: grpc.aio.Server) -> int:
        host = f"[{self.host}]" if ":" in self.host else self.host
        try:
            port = server.add_insecure_port(f"{host}:{self.requested_port}")
        except RuntimeError as error:
            raise OSError(f"gRPC cannot listen on {host}:{self.requested_port}: {error}") from None
        if port == 0:
            raise OSError(f"gRPC cannot listen on {host}:{self.requested_port}")
        return port

    async def stop(self, grace: float) -> None:
        """Refuse new calls; calls in flight get `grace` seconds, then are cancelled."""
        if self._server is not None:
            await self._server.stop(grace)
