"""One claimed job through the engine: resume from the persisted output, generate the rest, persist it
as it grows, keep the lease, honour a cancel, finish with an OpenAI-shaped result.

A job that a worker claims again (after a crash, or a lease that expired) continues from the tokens it
had persisted: the prompt becomes the original prompt plus those tokens and only the remaining
`max_tokens` are generated. Sampling continues from there (a seeded job is reproducible only when it
ran in one go).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from engine.async_engine import EngineUnavailableError
from engine.types import Request, RequestError, RequestOutput
from service.jobs.api import parse_job
from service.jobs.records import Job, JobStatus
from service.jobs.store import JobStore
from service.openai.errors import ApiError, from_exception
from service.openai.requests import Generation
from service.openai.responses import ChatFormat, Choice, CompletionFormat, Envelope, JsonObject, usage
from service.state import ServerState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerOptions:
    concurrency: int = field(default=4, metadata={
        "flag": "--job-concurrency", "metavar": "N", "help": "jobs this server runs at once"})
    lease_s: float = field(default=30.0, metadata={
        "flag": "--job-lease", "metavar": "S", "help": "a crashed server's running jobs resume elsewhere after this "
        "many seconds"})
    poll_s: float = 0.5  # how often to look for new jobs and for cancels requested elsewhere
    flush_tokens: int = 8  # persist after this many tokens ...
    flush_s: float = 0.5  # ... or this many seconds, whichever comes first
    max_attempts: int = 5  # a job whose workers died this many times fails

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.flush_tokens < 1 or self.max_attempts < 1:
            raise ValueError("job concurrency, flush tokens and max attempts must be at least 1")
        if not (self.lease_s > 0 and self.poll_s > 0 and self.flush_s > 0):
            raise ValueError("job lease, poll and flush times must be positive")


@dataclass
class _Pending:
    """Output not yet persisted."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    since: float = field(default_factory=time.monotonic)

    def add(self, out: RequestOutput) -> None:
        self.text.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)

    @property
    def is_empty(self) -> bool:
        return not self.token_ids and not any(self.text)

    def is_due(self, options: WorkerOptions) -> bool:
        return len(self.token_ids) >= options.flush_tokens or time.monotonic() - self.since >= options.flush_s


class JobRun:
    """Owns one claimed job until it finishes, is cancelled, or its lease goes to another worker."""

    def __init__(self, job: Job, worker_id: str, store: JobStore, state: ServerState, options: WorkerOptions,
                 on_persisted: Callable[[str], None], on_finished: Callable[[Job], None]) -> None:
        self.job, self.worker_id, self.store, self.state, self.options = job, worker_id, store, state, options
        self.request_id = f"{job.id}-{job.attempts}"
        self.is_cancelled = False  # the job's cancel was requested
        self.is_lost = False  # another worker owns the job now
        self.text = job.text  # everything persisted, across attempts
        self.num_tokens = job.progress_tokens
        self._pending = _Pending()
        self._on_persisted, self._on_finished = on_persisted, on_finished

    def stop(self, cancelled: bool) -> None:
        """Abort the generation; a cancelled job finishes as cancelled, otherwise it stays running for
        the next claim once its lease expires."""
        self.is_cancelled = self.is_cancelled or cancelled
        self.state.engine.abort(self.request_id)

    async def run(self) -> None:
        try:
            generation = await asyncio.to_thread(parse_job, self.job.kind, self.job.request, self.state.model)
        except (ApiError, RequestError) as error:  # the server's limits changed since the job was queued
            await self._finish("failed", error=from_exception(error).message)
            return
        done_ids = await asyncio.to_thread(self._persisted_ids)
        reason = self._done_reason(generation, done_ids)
        if reason is None:
            reason = await self._generate_with_lease(self._request(generation, done_ids))
        await self._end(generation, reason)

    def _persisted_ids(self) -> list[int]:
        return [t for event in self.store.events(self.job.id) for t in event.token_ids]

    def _done_reason(self, generation: Generation, done_ids: list[int]) -> str | None:
        """Why a resumed job needs no more tokens (it stopped just before its worker died), or None."""
        params = generation.params
        if len(done_ids) >= params.max_tokens:
            return "length"
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else self.state.tokenizer.stop_token_ids)
        return "stop" if done_ids and done_ids[-1] in stop_ids else None

    def _request(self, generation: Generation, done_ids: list[int]) -> Request:
        params = replace(generation.params, max_tokens=generation.params.max_tokens - len(done_ids))
        return Request(self.request_id, generation.prompts[0] + tuple(done_ids), params, time.perf_counter())

    async def _generate_with_lease(self, request: Request) -> str | None:
        keeper = asyncio.create_task(self._keep_lease())
        try:
            return await self._generate(request)
        except EngineUnavailableError as error:  # draining or dead: the job waits for another claim
            log.info("job %s left for another worker: %s", self.job.id, error)
            return None
        except RequestError as error:
            await self._finish("failed", error=str(error))
            return None
        finally:
            keeper.cancel()

    async def _generate(self, request: Request) -> str:
        reason = "abort"
        async with self.state.engine.open([request]) as stream:
            async for out in stream:
                self._pending.add(out)
                if out.finished:
                    reason = out.finish_reason or "abort"
                elif self._pending.is_due(self.options):
                    await self._flush()
        await self._flush()
        return reason

    async def _flush(self) -> None:
        pending, self._pending = self._pending, _Pending()
        if pending.is_empty or self.is_lost:
            return
        text = "".join(pending.text)
        seq = await asyncio.to_thread(self.store.append, self.job.id, self.worker_id, text, pending.token_ids)
        if seq is None:
            self._lose("its output could not be persisted")
            return
        self.text += text
        self.num_tokens += len(pending.token_ids)
        self._on_persisted(self.job.id)

    def _lose(self, why: str) -> None:
        if not self.is_lost:
            log.warning("job %s: this worker lost its lease (%s)", self.job.id, why)
        self.is_lost = True
        self.state.engine.abort(self.request_id)

    async def _keep_lease(self) -> None:
        renewed = time.monotonic()
        while not self.is_lost:
            await asyncio.sleep(self.options.poll_s)
            try:
                await self._check_cancel()
                if time.monotonic() - renewed >= self.options.lease_s / 3:
                    if not await asyncio.to_thread(self.store.renew, self.job.id, self.worker_id, self.options.lease_s):
                        self._lose("the lease was not renewed")
                    renewed = time.monotonic()
            except Exception:  # a store hiccup: the lease outlives a few missed renewals
                log.exception("job %s: keeping the lease failed", self.job.id)

    async def _check_cancel(self) -> None:
        job = await asyncio.to_thread(self.store.get, self.job.id)
        if job is None or job.status != "running" or job.worker_id != self.worker_id:
            self._lose("the job changed owner")
        elif job.cancel_requested:
            self.stop(cancelled=True)

    async def _end(self, generation: Generation, reason: str | None) -> None:
        if reason is None or self.is_lost:
            return
        if reason == "abort":
            if self.is_cancelled:
                await self._finish("cancelled")
            return  # aborted by a drain: resumed by the next claim
        await self._finish("succeeded", result=self._result(generation, reason))

    async def _finish(self, status: JobStatus, *, result: JsonObject | None = None, error: str | None = None) -> None:
        finished = await asyncio.to_thread(self.store.finish, self.job.id, self.worker_id, status,
                                           result=result, error=error)
        if not finished:
            self._lose("finishing was refused")
            return
        job = await asyncio.to_thread(self.store.get, self.job.id)
        if job is not None:
            self._on_finished(job)

    def _result(self, generation: Generation, reason: str) -> JsonObject:
        """The OpenAI completion or chat.completion object of the whole job."""
        tokenizer = self.state.tokenizer
        fmt = ChatFormat(tokenizer, False) if self.job.kind == "chat" else CompletionFormat(tokenizer, False)
        env = Envelope(f"{fmt.id_prefix}-{self.job.id.removeprefix('job_')}", int(self.job.created_at),
                       self.state.model_name, self.state.fingerprint)
        choice = Choice(0, [self.text], [], reason, self.num_tokens)
        return env.wrap(fmt.object, choices=[fmt.choice(choice)],
                        usage=usage(len(generation.prompts[0]), self.num_tokens))
