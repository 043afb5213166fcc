"""AsyncEngine: the asyncio face of LLMEngine.

One engine thread owns the LLMEngine: it loads it, steps it and closes it, so the event loop never
blocks on the device. Adds and aborts are commands the thread applies between steps; outputs fan out
to one asyncio queue per submitted group of requests through `loop.call_soon_threadsafe`. Errors (a
rejected request, a failed engine) travel through the same queues as values and are raised by the
consumer's iterator.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

import numpy as np

from engine.config import EngineConfig
from engine.expert_cache.stats import CacheStatsSnapshot
from engine.gguf.tokenizer import Tokenizer
from engine.llm_engine import EngineStats, LLMEngine
from engine.types import Request, RequestError, RequestOutput

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]
Load = Callable[[EngineConfig, Progress | None], LLMEngine]  # how the engine thread builds the engine
ABORT_GRACE_S = 10.0  # aborts land within one step; this only bounds a wedged device
CACHE_PUBLISH_S = 0.1  # the cache's figures and usage map, copied at most this often while busy (readers: 0.5 s)
# NOTE: the engine thread waits on the device with the GIL released; when the step ends it must get the GIL back
# from the event loop, which may be in the middle of the last step's outputs (text, SSE or protobuf, writes). Python
# hands the GIL over to a waiting thread only after its switch interval (5 ms by default). A shorter interval bounds
# that wait but also preempts the engine thread's own Python as often: at 0.5 ms the server delivered 0.94-0.96 of the
# engine at 8 streaming clients and 0.78 at 32 (H100, 2026-12-07), against 0.89-0.90 at both with 5 ms (2026-12-06).
# So the interval stays Python's unless MOECACHE_GIL_SWITCH_MS sets it.


def _gil_switch_s(value: str) -> float:
    try:
        milliseconds = float(value)
    except ValueError:
        milliseconds = 0.0
    if not milliseconds > 0:
        raise ValueError(f"MOECACHE_GIL_SWITCH_MS: expected milliseconds > 0, got {value!r}")
    return milliseconds / 1e3


GIL_SWITCH_S = _gil_switch_s(os.environ["MOECACHE_GIL_SWITCH_MS"]) if "MOECACHE_GIL_SWITCH_MS" in os.environ else None


class EngineUnavailableError(RuntimeError):
    """The engine takes no requests now: loading, draining, stopped or failed."""


class EngineDeadError(EngineUnavailableError):
    """The engine loop failed; every pending request gets this error."""


@dataclass(frozen=True)
class EngineSnapshot:
    """What the engine thread published after its last step; safe to read from any thread."""

    stats: EngineStats = field(default_factory=lambda: EngineStats(0, 0, 0.0, 0, 0, 0, 0.0))
    cache: CacheStatsSnapshot | None = None
    # [num_layers, num_experts]: recent picks (float32, decayed per step) and where each expert is (int8:
    # 2 resident, 1 cached, 0 host RAM only, -2 on disk only, -1 dense layer); left out of ==, which numpy makes
    # ambiguous
    usage: np.ndarray | None = field(default=None, compare=False)
    where: np.ndarray | None = field(default=None, compare=False)


@dataclass(frozen=True)
class RequestMetrics:
    """Timings of one finished request, in seconds (perf_counter clock)."""

    request_id: str
    finish_reason: str
    num_prompt_tokens: int
    num_generated_tokens: int
    queue_time: float  # arrival -> first scheduled into a step
    time_to_first_token: float | None  # None: finished without a token (aborted while waiting)
    inter_token_latencies: tuple[float, ...]
    e2e_latency: float


# -- commands: event loop -> engine thread -----------------------------------------------------------
@dataclass(frozen=True)
class _Add:
    requests: tuple[Request, ...]


@dataclass(frozen=True)
class _Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class _Stop:
    pass


_Command = _Add | _Abort | _Stop


class _Inbox:
    """Commands for the engine thread; `take` blocks only while the engine has nothing to do."""

    def __init__(self) -> None:
        self._items: deque[_Command] = deque()
        self._ready = threading.Condition()

    def put(self, command: _Command) -> None:
        with self._ready:
            self._items.append(command)
            self._ready.notify()

    def take(self, wait: bool) -> list[_Command]:
        with self._ready:
            while wait and not self._items:
                self._ready.wait()
            items = list(self._items)
            self._items.clear()
        return items


# -- events: engine thread -> event loop -------------------------------------------------------------
@dataclass
class _Events:
    """What one turn of the engine loop produced, handed to the event loop in one call."""

    step_start: float = 0.0
    ready_at: float = field(default_factory=time.perf_counter)  # when the outputs were ready
    admitted: list[tuple[str, RequestError | None]] = field(default_factory=list)  # (first id, error)
    scheduled: list[str] = field(default_factory=list)  # got a KV slot in this turn
    outputs: list[RequestOutput] = field(default_factory=list)


@dataclass
class _Timer:
    arrival: float
    scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)

    def metrics(self, out: RequestOutput, now: float) -> RequestMetrics:
        times = self.token_times
        return RequestMetrics(
            out.request_id, out.finish_reason or "abort", out.num_prompt_tokens, out.num_generated_tokens,
            (self.scheduled or now) - self.arrival, times[0] - self.arrival if times else None,
            tuple(b - a for a, b in zip(times, times[1:])), now - self.arrival)


class RequestStream:
    """Outputs of a group of requests (the choices of one API call) in step order; an async iterator
    that ends when every request finished and raises what the engine sent as an error. What arrived while
    the consumer was busy comes as one output per request, so a slow consumer does less work per token,
    not more."""

    def __init__(self, requests: Sequence[Request], arrival: float) -> None:
        self.request_ids = tuple(r.request_id for r in requests)
        self.admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._timers = {r.request_id: _Timer(r.arrival_time or arrival) for r in requests}
        self._undelivered = set(self.request_ids)  # not yet finished on the engine side
        self._unread = set(self.request_ids)  # not yet finished on the consumer side
        self._ready: deque[RequestOutput | BaseException] = deque()  # taken from the queue, not yet read

    @property
    def is_finished(self) -> bool:
        return not self._undelivered

    @property
    def unfinished_ids(self) -> tuple[str, ...]:
        return tuple(i for i in self.request_ids if i in self._undelivered)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unread:
            raise StopAsyncIteration
        if not self._ready:
            # NOTE: a consumer that fell behind gets what queued up meanwhile as one output per request
            first = await self._queue.get()
            self._ready.extend(coalesce([first, *(self._queue.get_nowait() for _ in range(self._queue.qsize()))]))
        item = self._ready.popleft()
        if isinstance(item, BaseException):
            self._unread.clear()
            self._ready.clear()
            raise item
        if item.finished:
            self._unread.discard(item.request_id)
        return item

    def mark_scheduled(self, request_id: str, at: float) -> None:
        self._timers[request_id].scheduled = at

    def deliver(self, out: RequestOutput, at: float) -> RequestMetrics | None:
        """Queue one output; the request's metrics when it finished."""
        timer = self._timers[out.request_id]
        if out.new_token_ids:
            timer.token_times.append(at)
        self._queue.put_nowait(out)
        if not out.finished:
            return None
        self._undelivered.discard(out.request_id)
        return timer.metrics(out, at)

    def fail(self, error: BaseException) -> None:
        self._undelivered.clear()
        if not self.admitted.done():
            self.admitted.set_exception(error)
        else:
            self._queue.put_nowait(error)


def coalesce(items: Sequence[RequestOutput | BaseException]) -> list[RequestOutput | BaseException]:
    """Outputs of several steps as one per request, in the order of each request's first; an error last
    (nothing follows it)."""
    merged: dict[str, RequestOutput] = {}
    for item in items:
        if isinstance(item, BaseException):
            return [*merged.values(), item]
        earlier = merged.get(item.request_id)
        merged[item.request_id] = item if earlier is None else earlier.then(item)
    return list(merged.values())


class AsyncEngine:
    """Runs an LLMEngine in its own thread and serves many concurrent requests from asyncio. The thread
    builds it with `load(config, progress)`, or serves the already loaded `engine`."""

    def __init__(self, config: EngineConfig, progress: Progress | None = None,
                 on_finish: Callable[[RequestMetrics], None] | None = None,
                 engine: LLMEngine | None = None, load: Load = LLMEngine) -> None:
        self.config = config
        self.on_finish = on_finish
        self._progress = progress
        self._llm = engine  # NOTE: touched only by the engine thread once start() ran
        self._load = load
        self._inbox = _Inbox()
        self._streams: dict[str, RequestStream] = {}  # request id -> its group's stream (loop side)
        self._snapshot = EngineSnapshot()
        self._cache_published = 0.0  # perf_counter time of the last snapshot of the cache (engine thread)
        self._held: _Events | None = None  # the last step's events, not yet handed to the loop (`_hand_over`)
        self._is_ready = self._is_dead = self._is_draining = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loaded: asyncio.Future[None] | None = None
        self._idle: asyncio.Event | None = None
        self.tokenizer: Tokenizer | None = None
        self.max_model_len = 0
        self.description = ""

    @classmethod
    def from_engine(cls, engine: LLMEngine, on_finish: Callable[[RequestMetrics], None] | None = None
                    ) -> AsyncEngine:
        """Wrap a loaded engine; from start() on, only the engine thread may call it."""
        return cls(engine.config, on_finish=on_finish, engine=engine)

    # -- state ------------------------------------------------------------------------------------
    @property
    def is_ready(self) -> bool:
        return self._is_ready and not self._is_dead

    @property
    def is_dead(self) -> bool:
        return self._is_dead

    @property
    def is_accepting(self) -> bool:
        return self.is_ready and not self._is_draining

    def stats(self) -> EngineSnapshot:
        return self._snapshot

    @property
    def num_running(self) -> int:
        return self._snapshot.stats.num_running

    @property
    def num_waiting(self) -> int:
        return self._snapshot.stats.num_waiting

    @property
    def num_pending(self) -> int:
        """Requests submitted and not yet finished, as the event loop sees them."""
        return len(self._streams)

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the engine thread; returns once the model is loaded (raises what loading raised)."""
        if self._thread is not None:
            raise RuntimeError("the engine was already started")
        self._loop = asyncio.get_running_loop()
        self._loaded = self._loop.create_future()
        self._idle = asyncio.Event()
        self._idle.set()
        if GIL_SWITCH_S is not None:
            sys.setswitchinterval(GIL_SWITCH_S)  # the process's: the engine thread is what it serves
        self._thread = threading.Thread(target=self._run, name="moecache-engine", daemon=True)
        self._thread.start()
        await asyncio.shield(self._loaded)

    async def drain(self, timeout: float) -> int:
        """Stop admitting; give the pending requests `timeout` seconds, then abort the rest.
        Returns how many were aborted."""
        self._is_draining = True
        if await self._wait_idle(timeout):
            return 0
        ids = tuple(self._streams)
        self._inbox.put(_Abort(ids))
        await self._wait_idle(ABORT_GRACE_S)
        return len(ids)

    async def shutdown(self) -> None:
        """Stop the engine thread and close the engine (its cache summary goes to the log)."""
        self._is_draining = True
        if self._thread is None:
            return
        self._inbox.put(_Stop())
        await asyncio.to_thread(self._thread.join)
        self._fail_all(EngineUnavailableError("the engine stopped"))

    async def _wait_idle(self, timeout: float) -> bool:
        if self._idle is None:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    # -- requests ---------------------------------------------------------------------------------
    @asynccontextmanager
    async def open(self, requests: Sequence[Request]) -> AsyncIterator[RequestStream]:
        """Submit a group of requests and wait until the engine admitted them (RequestError if not);
        leaving the block aborts whatever has not finished (a client that went away)."""
        stream = await self._submit(requests)
        try:
            yield stream
        finally:
            if not stream.is_finished:
                self._inbox.put(_Abort(stream.unfinished_ids))

    async def generate(self, request: Request) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request; close the iterator (e.g. `contextlib.aclosing`) to abort it early."""
        async with self.open([request]) as stream:
            async for out in stream:
                yield out

    def abort(self, request_id: str) -> None:
        """Abort a request; its stream gets a last output with finish_reason "abort". Thread-safe."""
        self._inbox.put(_Abort((request_id,)))

    async def _submit(self, requests: Sequence[Request]) -> RequestStream:
        self._check_accepting()
        ids = [r.request_id for r in requests]
        if not ids or len(set(ids)) != len(ids) or any(i in self._streams for i in ids):
            raise RequestError(f"request ids {ids} are empty, repeated or already running")
        stream = RequestStream(requests, time.perf_counter())
        self._register(stream)
        self._inbox.put(_Add(tuple(requests)))
        try:
            await stream.admitted
        except asyncio.CancelledError:
            self._inbox.put(_Abort(stream.request_ids))
            raise
        return stream

    def _check_accepting(self) -> None:
        if self._is_dead:
            raise EngineDeadError("the engine stopped after an error")
        if not self._is_ready:
            raise EngineUnavailableError("the model is still loading")
        if self._is_draining:
            raise EngineUnavailableError("the server is shutting down")

    def _register(self, stream: RequestStream) -> None:
        for request_id in stream.request_ids:
            self._streams[request_id] = stream
        if self._idle is not None:
            self._idle.clear()

    def _unregister(self, stream: RequestStream) -> None:
        for request_id in stream.request_ids:
            self._streams.pop(request_id, None)
        if not self._streams and self._idle is not None:
            self._idle.set()

    # -- event loop side: deliveries from the engine thread ---------------------------------------
    def _deliver(self, events: _Events) -> None:
        for first_id, error in events.admitted:
            self._admit(first_id, error)
        for request_id in events.scheduled:
            if request_id in self._streams:
                self._streams[request_id].mark_scheduled(request_id, events.step_start)
        for out in events.outputs:
            self._deliver_output(out, events.ready_at)

    def _admit(self, first_id: str, error: RequestError | None) -> None:
        stream = self._streams.get(first_id)
        if stream is None:
            return
        if error is not None:
            self._unregister(stream)
        if stream.admitted.done():  # the submitter was cancelled; its abort is already queued
            return
        if error is None:
            stream.admitted.set_result(None)
        else:
            stream.admitted.set_exception(error)

    def _deliver_output(self, out: RequestOutput, at: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        metrics = stream.deliver(out, at)
        if stream.is_finished:
            self._unregister(stream)
        if metrics is not None and self.on_finish is not None:
            try:
                self.on_finish(metrics)
            except Exception:  # an observer's bug must not stop the deliveries
                log.exception("request metrics observer failed")

    def _fail_all(self, error: BaseException) -> None:
        for stream in {id(s): s for s in self._streams.values()}.values():
            stream.fail(error)
            self._unregister(stream)

    def _on_loaded(self, error: BaseException | None) -> None:
        if self._loaded is None or self._loaded.done():
            return
        if error is None:
            self._loaded.set_result(None)
        else:
            self._loaded.set_exception(error)

    def _on_failure(self, error: BaseException) -> None:
        self._on_loaded(error)
        self._fail_all(EngineDeadError(f"the engine stopped after an error: {error}"))

    def _post(self, callback: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass

    # -- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        llm = None
        try:
            llm = self._llm or self._load(self.config, self._progress)
            self._ready_with(llm)
            self._serve(llm)
        except BaseException as error:  # every failure must reach the waiting requests, after what was done
            log.exception("the engine loop failed")
            self._is_dead = True
            self._hand_over()
            self._post(self._on_failure, error)
        finally:
            if llm is not None:
                self._close(llm)

    def _ready_with(self, llm: LLMEngine) -> None:
        self.tokenizer, self.max_model_len = llm.tokenizer, llm.max_model_len
        self.description = llm.cache.describe()
        self._publish_stats(llm)
        self._is_ready = True
        self._post(self._on_loaded, None)

    def _serve(self, llm: LLMEngine) -> None:
        waiting: set[str] = set()  # admitted, not yet given a KV slot
        while True:
            # 1. take commands; block only while idle (the last step's events handed over first), so a busy engine
            #    never waits for the loop
            if not llm.has_unfinished():
                self._hand_over()
            commands = self._inbox.take(wait=not llm.has_unfinished())
            events = _Events()
            # 2. apply adds and aborts between steps (an aborted request frees its KV slot now)
            if not self._apply(llm, commands, events, waiting):
                self._hand_over()
                self._post(self._deliver, events)
                return
            # 3. one step: decode tokens first, then chunked prefill (the scheduler's batching); the last step's
            #    events go to the loop once this one is launched
            events.step_start = time.perf_counter()
            events.outputs += llm.step(on_launched=self._hand_over)
            self._hand_over()  # an empty step launched nothing
            events.ready_at = time.perf_counter()
            # 4. queue time ends for requests that got a KV slot in this step
            events.scheduled = [i for i in waiting if _has_slot(llm, i)]
            waiting.difference_update(events.scheduled)
            # 5. publish stats (the cache's at most every CACHE_PUBLISH_S and when idle), then hand admissions
            #    and outputs to the event loop in one call, now or once the next step is launched
            self._publish_stats(llm, with_cache=not llm.has_unfinished()
                                or events.ready_at - self._cache_published >= CACHE_PUBLISH_S)
            self._held = events
            if not llm.launches_async:
                self._hand_over()

    def _hand_over(self) -> None:
        """The last step's events to the event loop. NOTE: where a step only launches the device's work (CUDA),
        they wait for the next step's launch: the loop's work on them (text, SSE or protobuf, socket writes) then
        runs while the device computes, not while this thread prepares that launch, taking turns with it at the GIL
        at each call into torch."""
        if self._held is not None:
            events, self._held = self._held, None
            self._post(self._deliver, events)

    def _apply(self, llm: LLMEngine, commands: list[_Command], events: _Events, waiting: set[str]) -> bool:
        for command in commands:
            if isinstance(command, _Stop):
                return False
            if isinstance(command, _Add):
                error = _add_group(llm, command.requests)
                events.admitted.append((command.requests[0].request_id, error))
                waiting.update(r.request_id for r in command.requests if error is None)
            else:
                events.outputs += [out for i in command.request_ids if (out := llm.abort(i)) is not None]
        return True

    def _publish_stats(self, llm: LLMEngine, with_cache: bool = True) -> None:
        if not with_cache:
            self._snapshot = replace(self._snapshot, stats=llm.stats())
            return
        usage, where = llm.cache.usage_snapshot()  # copies: the next step may change the cache's own arrays
        self._snapshot = EngineSnapshot(llm.stats(), llm.cache.snapshot(), usage, where)
        self._cache_published = time.perf_counter()

    def _close(self, llm: LLMEngine) -> None:
        try:
            llm.close()
        except Exception:
            log.exception("closing the engine failed")


def _add_group(llm: LLMEngine, requests: Sequence[Request]) -> RequestError | None:
    """Add every request of a group, or none: a rejected one takes back those already added."""
    for index, request in enumerate(requests):
        try:
            llm.add_request(request)
        except RequestError as error:
            for added in requests[:index]:
                llm.abort(added.request_id)
            return error
    return None


def _has_slot(llm: LLMEngine, request_id: str) -> bool:
    return not llm.scheduler.is_waiting(request_id)  # also once it is gone (finished or aborted)
