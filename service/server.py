"""The server process: bind, load the model in the engine thread, serve, drain on SIGTERM/SIGINT.

The socket is bound first so `/health` answers 503 while the model loads; the API answers once the
engine is ready. Draining stops admitting (503), lets running requests finish within the shutdown
timeout, aborts the rest (streams still get their last chunk and `[DONE]`), then closes the engine.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from aiohttp import web

from engine.async_engine import AsyncEngine, Load, Progress
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from service import logs
from service.engine_setup import load_engine
from service.grpc_api.server import GrpcServer
from service.http import build_app
from service.jobs.runtime import JobOptions, Jobs
from service.metrics import Metrics
from service.openai.limits import Admission, Limits
from service.state import ServerState

log = logging.getLogger(__name__)

HANDLER_GRACE_S = 10.0  # after the engine drained: time for handlers to write their last chunks
EMBEDDED_MODEL_NAME = "moecache-embedded"
DEFAULT_GRPC_PORT = 50051  # `moecache serve`'s; a Server built in code serves gRPC only when given a port


@dataclass(frozen=True)
class ServeOptions:
    host: str = field(default="127.0.0.1", metadata={"flag": "--host", "help": "the address of the HTTP and gRPC "
                                                     "servers"})
    port: int = field(default=8000, metadata={"flag": "--port", "help": "0: any free port (the log names it)"})
    model_name: str | None = field(default=None, metadata={
        "flag": "--served-model-name", "help": "the model id of the API (default: the file name)"})
    api_key: str | None = field(default=None, metadata={
        "flag": "--api-key", "help": "require `Authorization: Bearer KEY` (also MOECACHE_API_KEY)"})
    limits: Limits = field(default_factory=Limits)
    shutdown_timeout: float = field(default=30.0, metadata={
        "flag": "--shutdown-timeout", "metavar": "S", "help": "on SIGTERM, seconds for running requests to finish "
        "before they are aborted"})
    grpc_port: int | None = None  # None: no gRPC server; 0: any free port (see Server.grpc.port)
    jobs: JobOptions | None = None  # None: no job, file and batch API and no job worker

    def __post_init__(self) -> None:
        if self.shutdown_timeout < 0:
            raise ValueError("shutdown_timeout must be >= 0")


def served_model_name(config: EngineConfig, options: ServeOptions) -> str:
    if options.model_name:
        return options.model_name
    return Path(config.model.path).stem if config.model.path else EMBEDDED_MODEL_NAME


def package_version() -> str:
    try:
        return version("moecache")
    except PackageNotFoundError:
        return "0+unknown"


class Server:
    """One server: an AsyncEngine behind the HTTP API. `engine` serves an already loaded engine; else the
    engine thread loads one with `load` (the embedded model when the config names none)."""

    def __init__(self, config: EngineConfig, options: ServeOptions, progress: Progress | None = None,
                 engine: LLMEngine | None = None, load: Load = load_engine) -> None:
        self.options = options
        name = served_model_name(config, options)
        self.metrics = Metrics(name)
        self.engine = AsyncEngine(config, progress, on_finish=self.metrics.observe, engine=engine, load=load)
        limits = options.limits
        self.admission = Admission(limits.max_concurrent_requests, limits.max_queued_requests)
        self.metrics.watch(self.engine.stats, lambda: self.admission.num_queued)
        self.state = ServerState(self.engine, self.metrics, self.admission, limits, name, package_version(),
                                 options.api_key, int(time.time()))
        self.jobs = Jobs(options.jobs, self.state) if options.jobs is not None else None
        grpc_port = options.grpc_port
        self.grpc = GrpcServer(self.state, self.jobs, options.host, grpc_port) if grpc_port is not None else None
        # NOTE: bodies are decoded by the API (`http/errors.py`), so a bad Content-Encoding is its 4xx
        self.runner = web.AppRunner(build_app(self.state, self.jobs), handler_cancellation=True, access_log=None,
                                    shutdown_timeout=HANDLER_GRACE_S, auto_decompress=False)
        self._site: web.TCPSite | None = None
        db_url = options.jobs.db_url if options.jobs is not None else None
        self._redact = logs.Redact(logs.secrets_of(options.api_key, db_url))

    @property
    def port(self) -> int:
        """The bound port (the real one when options.port is 0)."""
        assert self.runner.addresses, "the server is not started"
        return int(self.runner.addresses[0][1])

    async def start(self) -> None:
        """Bind and serve (503 while loading), then load the model; raises what loading raised."""
        logs.install(self._redact)
        await self.runner.setup()
        self._site = web.TCPSite(self.runner, self.options.host, self.options.port)
        await self._site.start()
        log.info("listening on http://%s:%d (loading the model)", self.options.host, self.port)
        if self.grpc is not None:
            await self.grpc.start()
        if self.jobs is not None:
            await self.jobs.open()  # before loading: a wrong --jobs-db fails fast
        await self.engine.start()
        log.info("%s", self.engine.description)
        if self.jobs is not None:
            self.jobs.start()
        log.info("ready: model %s, context %d tokens, %d concurrent requests", self.state.model_name,
                 self.engine.max_model_len, self.options.limits.max_concurrent_requests)

    async def stop(self) -> None:
        """Drain: stop admitting, finish or abort what runs, close the HTTP side, close the engine.
        Jobs aborted by the drain keep their persisted output and resume on the next claim."""
        if self.jobs is not None:
            self.jobs.stop_claiming()
        aborted = await self.engine.drain(self.options.shutdown_timeout)
        if aborted:
            log.info("aborted %d requests still running after %.0f s", aborted, self.options.shutdown_timeout)
        await self.admission.wait_idle(HANDLER_GRACE_S)
        await self.runner.cleanup()
        if self.grpc is not None:
            await self.grpc.stop(HANDLER_GRACE_S)
        if self.jobs is not None:
            await self.jobs.stop(HANDLER_GRACE_S)  # the job runs ended with the drain; then the store closes
        await self.engine.shutdown()
        log.info("stopped")
        logs.uninstall(self._redact)


async def serve(config: EngineConfig, options: ServeOptions, progress: Progress | None = None,
                load: Load = load_engine) -> int:
    """Run until SIGTERM or SIGINT, then drain; 0 after a clean drain, 1 if the model failed to load."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    server = Server(config, options, progress, load=load)
    starting = asyncio.create_task(server.start())
    signalled = asyncio.create_task(stopping.wait())
    await asyncio.wait({starting, signalled}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done() and starting.exception() is not None:
        log.error("the server did not start: %s", starting.exception())
        await server.stop()
        return 1
    await stopping.wait()
    log.info("signal received: draining (up to %.0f s)", options.shutdown_timeout)
    starting.cancel()  # a signal during loading: stop() waits for the load, then closes the engine
    await server.stop()
    return 0
