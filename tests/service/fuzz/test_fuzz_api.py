"""Fuzzing the HTTP and gRPC APIs of a real `moecache serve`: first the seed corpus (valid requests of
every endpoint and one request of each class of bad input found before: deep nesting, unpaired
surrogates, digits that are not ASCII, oversized numbers, malformed uploads, bodies that do not decode,
requests the engine would refuse, corrupt protobuf messages, ...), each with the answer it must get;
then schema-guided mutations of the seeds (hypothesis), bounded in requests and in time.

Every answer must pass the oracle: no 5xx, an error is OpenAI's JSON error object naming no exception
class, an event stream ends with its last event, a gRPC status is never UNKNOWN or INTERNAL. At the end
no request may still run, and the server's log holds no error and not the API key.

It runs against a server whose job store is SQLite, then one on PostgreSQL (with a third of the budget).
MOECACHE_FUZZ_REQUESTS (default 3000) and MOECACHE_FUZZ_SECONDS (default 75) bound the mutations of one
server; MOECACHE_FUZZ_SEED explores other mutations than the fixed default ones.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import grpc
import pytest
from fuzz_grpc import GrpcCase, GrpcOutcome, Methods, case_from_corpus
from fuzz_grpc import call as grpc_call
from fuzz_grpc import judge as grpc_judge
from fuzz_grpc import mutated_case as grpc_mutant
from fuzz_http import HttpCase, Outcome, check_expect, send, send_raw
from fuzz_server import API_KEY, FuzzServer, corpus_lines, http_case
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from mutations import mutated_case as http_mutant

from service.grpc_api.stubs import load

REQUESTS = int(os.environ.get("MOECACHE_FUZZ_REQUESTS", "3000"))
SECONDS = float(os.environ.get("MOECACHE_FUZZ_SECONDS", "75"))
SEED = os.environ.get("MOECACHE_FUZZ_SEED")
BATCH = 24  # requests of one example, sent at once
CONCURRENCY = 8
GRPC_SHARE = 0.3  # of the requests and of the time
SETTLE_S = 60.0
MAX_REPORTED = 40


def fuzz_settings(num_requests: int) -> Callable[[Any], Any]:
    def apply(test: Any) -> Any:
        configured = settings(max_examples=max(1, num_requests // BATCH), deadline=None, database=None,
                              derandomize=SEED is None, phases=(Phase.generate,), print_blob=False,
                              suppress_health_check=list(HealthCheck))(test)
        return seed(int(SEED))(configured) if SEED is not None else configured
    return apply


class Budget:
    """Requests sent so far, the time left for the mutations of one transport, and what failed (all of it
    is collected, so one run reports every class of failure it met, not only the first)."""

    def __init__(self, seconds: float) -> None:
        self.deadline, self.sent = time.monotonic() + seconds, 0
        self.failures: list[str] = []
        self.answers: Counter[str] = Counter()  # status (and `stream` for an event stream) -> count

    @property
    def is_spent(self) -> bool:
        return time.monotonic() > self.deadline

    def summary(self) -> str:
        return f"{self.sent} sent: " + ", ".join(f"{k} x{n}" for k, n in sorted(self.answers.items()))

    def report(self) -> str:
        return f"{len(self.failures)} of {self.sent} failed:\n" + "\n".join(self.failures[:MAX_REPORTED])


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    running = asyncio.new_event_loop()
    yield running
    running.close()


@pytest.fixture(scope="module")
def session(loop: asyncio.AbstractEventLoop) -> Iterator[aiohttp.ClientSession]:
    async def make() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60), connector=aiohttp.TCPConnector(limit=100))

    opened = loop.run_until_complete(make())
    yield opened
    loop.run_until_complete(opened.close())


@pytest.fixture(scope="module")
def channel(loop: asyncio.AbstractEventLoop, fuzz_server: FuzzServer) -> Iterator[grpc.aio.Channel]:
    async def make() -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(fuzz_server.grpc_target)

    opened = loop.run_until_complete(make())
    yield opened
    loop.run_until_complete(opened.close())


@pytest.fixture(scope="module")
def methods() -> Methods:
    return Methods(load())


@pytest.fixture(scope="module")
def http_seeds(fuzz_server: FuzzServer) -> list[HttpCase]:
    return [http_case(line) for line in corpus_lines("http.jsonl", fuzz_server.ids) if "raw" not in line]


@pytest.fixture(scope="module")
def grpc_seeds(fuzz_server: FuzzServer, methods: Methods) -> list[GrpcCase]:
    return [case_from_corpus(line, methods, API_KEY) for line in corpus_lines("grpc.jsonl", fuzz_server.ids)]


async def gathered(jobs: list[Awaitable[Any]]) -> list[Any]:
    limit = asyncio.Semaphore(CONCURRENCY)

    async def one(job: Awaitable[Any]) -> Any:
        async with limit:
            return await job

    return list(await asyncio.gather(*(one(job) for job in jobs)))


def test_the_seed_corpus_gets_the_answers_it_must(loop: asyncio.AbstractEventLoop, session: aiohttp.ClientSession,
                                                 fuzz_server: FuzzServer, http_seeds: list[HttpCase]) -> None:
    outcomes: list[Outcome] = [loop.run_until_complete(send(session, fuzz_server.base_url, case))
                               for case in http_seeds]
    for line in corpus_lines("http.jsonl", fuzz_server.ids):
        if "raw" in line:
            raw = line["raw"].encode("latin-1")
            outcomes.append(loop.run_until_complete(send_raw("127.0.0.1", fuzz_server.process.port, raw, line["name"])))
    for outcome in outcomes:
        outcome.problems += check_expect(outcome)
    failures = [o.describe() for o in outcomes if o.problems]
    assert not failures, "\n".join(failures)


def test_the_grpc_seed_corpus_gets_the_answers_it_must(loop: asyncio.AbstractEventLoop, channel: grpc.aio.Channel,
                                                      methods: Methods, grpc_seeds: list[GrpcCase]) -> None:
    outcomes = [loop.run_until_complete(grpc_call(channel, case, methods.is_streaming(case.method)))
                for case in grpc_seeds]
    failures = [o.describe() + "; ".join(grpc_judge(o, methods)) for o in outcomes if grpc_judge(o, methods)]
    assert not failures, "\n".join(failures)


def test_mutated_http_requests_pass_the_oracle(loop: asyncio.AbstractEventLoop, session: aiohttp.ClientSession,
                                               fuzz_server: FuzzServer, http_seeds: list[HttpCase]) -> None:
    share = fuzz_server.share * (1 - GRPC_SHARE)
    budget = Budget(SECONDS * share)
    seeds = [case for case in http_seeds if not case.hold]
    mutant = st.sampled_from(seeds).flatmap(lambda s: http_mutant(s, API_KEY, fuzz_server.ids))

    @fuzz_settings(int(REQUESTS * share))
    @given(st.lists(mutant, min_size=BATCH, max_size=BATCH))
    def run(cases: list[HttpCase]) -> None:
        if budget.is_spent:
            return
        outcomes = loop.run_until_complete(gathered([send(session, fuzz_server.base_url, c) for c in cases]))
        budget.sent += len(cases)
        budget.failures += [o.describe() for o in outcomes if o.problems]
        budget.answers.update(f"{o.status}{' stream' if o.content_type == 'text/event-stream' else ''}"
                              for o in outcomes)

    run()
    print(f"\nmutated HTTP requests: {budget.summary()}")
    assert not budget.failures, budget.report()
    assert budget.sent >= BATCH  # the mutations ran


def test_mutated_grpc_calls_pass_the_oracle(loop: asyncio.AbstractEventLoop, channel: grpc.aio.Channel,
                                            methods: Methods, grpc_seeds: list[GrpcCase],
                                            fuzz_server: FuzzServer) -> None:
    share = fuzz_server.share * GRPC_SHARE
    budget = Budget(SECONDS * share)
    mutant = st.sampled_from(grpc_seeds).flatmap(lambda s: grpc_mutant(s, methods, API_KEY))

    @fuzz_settings(int(REQUESTS * share))
    @given(st.lists(mutant, min_size=BATCH, max_size=BATCH))
    def run(cases: list[GrpcCase]) -> None:
        if budget.is_spent:
            return
        calls = [grpc_call(channel, c, methods.is_streaming(c.method)) for c in cases]
        outcomes: list[GrpcOutcome] = loop.run_until_complete(gathered(calls))
        budget.sent += len(cases)
        budget.failures += [o.describe() + "; ".join(grpc_judge(o, methods)) for o in outcomes
                            if grpc_judge(o, methods)]
        budget.answers.update(o.code.name for o in outcomes)

    run()
    print(f"\nmutated gRPC calls: {budget.summary()}")
    assert not budget.failures, budget.report()
    assert budget.sent >= BATCH  # the mutations ran


def test_no_request_is_left_running_and_no_secret_or_error_is_logged(
        loop: asyncio.AbstractEventLoop, session: aiohttp.ClientSession, fuzz_server: FuzzServer) -> None:
    loop.run_until_complete(cancel_all_jobs(session, fuzz_server.base_url))
    gauges = loop.run_until_complete(settled(session, fuzz_server.base_url))
    assert gauges == {"moecache_requests_running": 0, "moecache_requests_waiting": 0, "jobs_running": 0}
    log = fuzz_server.process.log()
    assert API_KEY not in log
    assert not re.search(r" (ERROR|CRITICAL) |Traceback", log), log[-5000:]


AUTH = {"Authorization": f"Bearer {API_KEY}"}


async def cancel_all_jobs(session: aiohttp.ClientSession, base_url: str) -> None:
    for status in ("queued", "running"):
        while True:
            async with session.get(f"{base_url}/v1/jobs?limit=100&status={status}", headers=AUTH) as r:
                page = (await r.json())["data"]
            for job in page:
                async with session.delete(f"{base_url}/v1/jobs/{job['id']}", headers=AUTH) as r:
                    assert r.status == 200
            if len(page) < 100:
                break


async def settled(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """The request gauges once they reach 0 (or their values after SETTLE_S)."""
    deadline, gauges = time.monotonic() + SETTLE_S, {}
    while time.monotonic() < deadline:
        async with session.get(f"{base_url}/metrics") as r:
            text = await r.text()
        gauges = {name: _sample(text, name) for name in ("moecache_requests_running", "moecache_requests_waiting")}
        gauges["jobs_running"] = _sample(text, "moecache_jobs", 'state="running"')
        if not any(gauges.values()):
            break
        await asyncio.sleep(0.25)
    return gauges


def _sample(text: str, name: str, label: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {label} not in /metrics")
