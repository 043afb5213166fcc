"""The gRPC server (`grpc.aio`), in the HTTP server's process and event loop, over the same AsyncEngine:
`moecache.v1.Generation`, `moecache.v1.Jobs` (with a job store), `grpc.health.v1.Health` (SERVING only
while the engine takes requests) and server reflection, behind the `Gate` interceptor (`gate.py`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from service.grpc_api.convert import STUBS, gen_pb, jobs_pb
from service.grpc_api.gate import Gate
from service.grpc_api.services import GenerationService, JobsService
from service.jobs.runtime import Jobs
from service.state import ServerState, engine_status

log = logging.getLogger(__name__)

HEALTH_WATCH_POLL_S = 0.25
GENERATION = gen_pb.DESCRIPTOR.services_by_name["Generation"].full_name
JOBS = jobs_pb.DESCRIPTOR.services_by_name["Jobs"].full_name


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
