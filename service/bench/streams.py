"""Streaming clients of a running server, timed: OpenAI completions over HTTP (server-sent events) and
`Generate` over gRPC. Each stream records when it was sent and when each chunk of tokens arrived."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
from prometheus_client.parser import text_string_to_metric_families

from service.grpc_api.stubs import load

HTTP, GRPC = "http", "grpc"
PATHS = (HTTP, GRPC)


@dataclass(frozen=True)
class StreamTiming:
    """One streamed request: perf_counter times of its start and of each chunk that carried tokens."""

    start: float
    arrivals: tuple[float, ...]
    chunk_tokens: tuple[int, ...]  # tokens of each chunk (HTTP: 1, its text's tokens are not sent)
    num_tokens: int  # as the server counted them (usage)

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.start

    @property
    def gaps(self) -> list[float]:
        """Inter-token latencies: the time between chunks, per token of the later chunk."""
        return [(b - a) / n for a, b, n in zip(self.arrivals, self.arrivals[1:], self.chunk_tokens[1:])]

    def tokens_after(self, t: float) -> int:
        """Tokens that arrived after `t` (the usage's count, less those of earlier chunks)."""
        return self.num_tokens - sum(n for at, n in zip(self.arrivals, self.chunk_tokens) if at <= t)


@dataclass(frozen=True)
class Load:
    """What each client asks for."""

    prompt: str
    max_tokens: int


class StreamError(RuntimeError):
    """A stream that failed or ended without tokens."""


# a stream of `Load`; it sets the event, when given, once its first tokens arrived
Client = Callable[[Load, asyncio.Event | None], Awaitable[StreamTiming]]


# -- HTTP ----------------------------------------------------------------------------------------------
def completion_body(load: Load) -> dict[str, Any]:
    return {"prompt": load.prompt, "max_tokens": load.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


SERVER_HISTOGRAMS = ("moecache_request_queue_time_seconds", "moecache_time_to_first_token_seconds")


async def server_totals(session: aiohttp.ClientSession, url: str) -> dict[str, float] | None:
    """The sums and counts of the server's queue-time and TTFT histograms (its /metrics, every model label added),
    by sample name; None where it has no /metrics."""
    async with session.get(f"{url}/metrics") as response:
        if response.status != 200:
            return None
        text = await response.text()
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in SERVER_HISTOGRAMS:
            for sample in family.samples:
                if sample.name.endswith(("_sum", "_count")):
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


async def http_stream(session: aiohttp.ClientSession, url: str, load: Load,
                      first: asyncio.Event | None = None) -> StreamTiming:
    start = time.perf_counter()
    arrivals: list[float] = []
    num_tokens = 0
    async with session.post(f"{url}/v1/completions", json=completion_body(load)) as response:
        if response.status != 200:
            raise StreamError(f"HTTP {response.status}: {await response.text()}")
        async for line in response.content:
            if line.startswith(b"event: error"):
                raise StreamError(f"the stream failed: {await response.content.readline()!r}")
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[len(b"data: "):])
            if event.get("usage"):
                num_tokens = event["usage"]["completion_tokens"]
            elif event["choices"] and event["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
                _set(first)
    return _timing(start, arrivals, [1] * len(arrivals), num_tokens)


def _set(first: asyncio.Event | None) -> None:
    if first is not None and not first.is_set():
        first.set()


def _timing(start: float, arrivals: list[float], chunk_tokens: list[int], num_tokens: int) -> StreamTiming:
    if not arrivals:
        raise StreamError(f"a stream ended without text ({num_tokens} tokens)")
    return StreamTiming(start, tuple(arrivals), tuple(chunk_tokens), num_tokens)


class HttpClients(AbstractAsyncContextManager["HttpClients"]):
    """Streams over one connection pool without a limit (every client streams at once)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> HttpClients:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._session is not None
        await self._session.close()

    async def stream(self, load: Load, first: asyncio.Event | None = None) -> StreamTiming:
        assert self._session is not None
        return await http_stream(self._session, self.url, load, first)

    async def totals(self) -> dict[str, float] | None:
        assert self._session is not None
        return await server_totals(self._session, self.url)


# -- gRPC ----------------------------------------------------------------------------------------------
class GrpcClients(AbstractAsyncContextManager["GrpcClients"]):
    """`Generation.Generate` streams over one channel (HTTP/2 streams side by side)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._stubs = load()
        self._channel: grpc.aio.Channel | None = None
        self._generate: Any = None

    async def __aenter__(self) -> GrpcClients:
        self._channel = grpc.aio.insecure_channel(self.target)
        self._generate = self._stubs.generation_grpc.GenerationStub(self._channel).Generate
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._channel is not None
        await self._channel.close()

    def request(self, load: Load) -> Any:
        pb = self._stubs.generation_pb2
        sampling = pb.SamplingParameters(max_tokens=load.max_tokens, temperature=0.0, ignore_eos=True)
        return pb.GenerateRequest(prompt=load.prompt, sampling=sampling)

    async def stream(self, load: Load, first: asyncio.Event | None = None) -> StreamTiming:
        request = self.request(load)
        start = time.perf_counter()
        arrivals: list[float] = []
        chunk_tokens: list[int] = []
        num_tokens = 0
        try:
            async for message in self._generate(request):
                if message.HasField("finished"):
                    num_tokens = message.finished.usage.completion_tokens
                elif message.chunk.text:
                    arrivals.append(time.perf_counter())
                    chunk_tokens.append(len(message.chunk.token_ids))
                    _set(first)
        except grpc.aio.AioRpcError as error:
            raise StreamError(f"gRPC {error.code().name}: {error.details()}") from None
        return _timing(start, arrivals, chunk_tokens, num_tokens)


# -- many at once --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """Streams started together, and the requests that joined them once all were decoding."""

    streams: tuple[StreamTiming, ...]
    joined: tuple[StreamTiming, ...]
    start: float
    end: float  # the last token of any stream

    @property
    def join_window(self) -> tuple[float, float] | None:
        """From the first joining request sent to the last one's first token: the running streams'
        tokens in it were decoded while prompts were coming in."""
        if not self.joined:
            return None
        return min(j.start for j in self.joined), max(j.arrivals[0] for j in self.joined)


async def run_clients(client: Client, loads: Sequence[Load], joining: Load | None = None,
                      num_joining: int = 0, every_s: float = 0.0) -> Run:
    """A stream of each of `loads`; once each has its first tokens, `num_joining` requests of
    `joining`, one every `every_s` seconds."""
    start = time.perf_counter()
    first_tokens = [asyncio.Event() for _ in loads]
    running = asyncio.gather(*(client(load, first) for load, first in zip(loads, first_tokens)))
    joined = []
    if joining is not None and num_joining:
        all_started = asyncio.ensure_future(asyncio.gather(*(first.wait() for first in first_tokens)))
        pending: list[asyncio.Future[Any]] = [all_started, running]
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)  # a failed stream ends the wait
        all_started.cancel()
        for _ in range(num_joining):
            joined.append(asyncio.ensure_future(client(joining, None)))
            await asyncio.sleep(every_s)
    streams = await running
    end = max(t.arrivals[-1] for t in streams)
    return Run(tuple(streams), tuple(await asyncio.gather(*joined)), start, end)
