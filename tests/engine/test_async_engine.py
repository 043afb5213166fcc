"""AsyncEngine on a real tiny GGUF: the engine thread, fan-out, errors as values, aborts, drain, death."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineUnavailableError,
    RequestMetrics,
    RequestStream,
    coalesce,
)
from engine.config import EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.types import Request, RequestError, RequestOutput, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def config(path: Path, decode_ahead: str = "auto") -> EngineConfig:
    return EngineConfig(model=ModelConfig(str(path), device="cpu", max_context=128),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128,
                                                  decode_ahead=decode_ahead))


@pytest.fixture(params=["off", "on"], ids=["in-turn", "decode-ahead"])
async def engine(tiny_gguf: Path, request: pytest.FixtureRequest) -> AsyncIterator[AsyncEngine]:
    """Every test on this engine runs with steps read in turn and with decode ahead (`LLMEngine.step`): aborts,
    drains, cancellations and concurrent streams between steps launched ahead."""
    eng = AsyncEngine(config(tiny_gguf, request.param))
    await eng.start()
    yield eng
    await eng.shutdown()


def request(eng: AsyncEngine, rid: str, text: str = "The quick brown fox",
            params: SamplingParams = GREEDY) -> Request:
    assert eng.tokenizer is not None
    return Request(rid, tuple(eng.tokenizer.encode(text)), params)


async def collect(eng: AsyncEngine, req: Request) -> list[RequestOutput]:
    return [out async for out in eng.generate(req)]


async def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout)


def run_sync(path: Path, reqs: list[Request]) -> dict[str, str]:
    llm = LLMEngine(config(path))
    for r in reqs:
        llm.add_request(r)
    texts: dict[str, str] = {r.request_id: "" for r in reqs}
    while llm.has_unfinished():
        for out in llm.step():
            texts[out.request_id] += out.new_text
    llm.close()
    return texts


async def test_not_ready_before_start_and_ready_after(tiny_gguf: Path) -> None:
    eng = AsyncEngine(config(tiny_gguf))
    assert not eng.is_ready and not eng.is_accepting
    with pytest.raises(EngineUnavailableError, match="loading"):
        await collect(eng, Request("a", (1, 2, 3), GREEDY))
    await eng.start()
    assert eng.is_ready and eng.max_model_len == 128 and "experts" in eng.description
    await eng.shutdown()


async def test_concurrent_requests_match_the_sync_engine(engine: AsyncEngine, tiny_gguf: Path) -> None:
    reqs = [request(engine, f"r{i}", text) for i, text in enumerate(["Hello there", "Once upon a time", "1 2 3"])]
    results = await asyncio.gather(*(collect(engine, r) for r in reqs))
    for outs in results:
        # NOTE: a consumer behind the engine reads the tokens of two steps in one output (`RequestOutput.then`): with
        # decode ahead a step's outputs can follow the last one's at once
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason == "length" and outs[-1].num_generated_tokens == 6
        assert sum(len(o.new_token_ids) for o in outs) == 6
    assert {r.request_id: "".join(o.new_text for o in outs) for r, outs in zip(reqs, results)} == \
        run_sync(tiny_gguf, reqs)


async def test_a_steps_outputs_reach_the_loop_once_the_next_step_is_launched(tiny_gguf: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Where launches are asynchronous (CUDA), the loop's work on step n's outputs overlaps step n + 1 on the device:
    they are handed over once it is launched, the last step's at once; nothing is lost or reordered."""
    llm = LLMEngine(config(tiny_gguf))
    llm.launches_async = True  # as on CUDA: the CPU's forward has run by then, the order is the same
    log: list[tuple[str, int, tuple[str, ...]]] = []  # the engine thread's order of launches, steps and hand-overs
    step = llm.step

    def logged_step(on_launched: Callable[[], None] | None = None) -> list[RequestOutput]:
        n = sum(1 for kind, *_ in log if kind == "stepped")

        def launched() -> None:
            log.append(("launched", n, ()))
            if on_launched is not None:
                on_launched()

        outputs = step(on_launched=launched)
        log.append(("stepped", n, tuple(o.request_id for o in outputs)))
        return outputs

    monkeypatch.setattr(llm, "step", logged_step)
    eng = AsyncEngine.from_engine(llm)
    post = eng._post

    def logged_post(callback: Callable[..., None], *args: Any) -> None:
        if args and hasattr(args[0], "outputs"):
            log.append(("handed", -1, tuple(o.request_id for o in args[0].outputs)))
        post(callback, *args)

    monkeypatch.setattr(eng, "_post", logged_post)
    await eng.start()
    reqs = [request(eng, f"r{i}", text) for i, text in enumerate(["Hello there", "Once upon a time"])]
    results = await asyncio.gather(*(collect(eng, r) for r in reqs))
    await eng.shutdown()
    assert {r.request_id: "".join(o.new_text for o in outs) for r, outs in zip(reqs, results)} == \
        run_sync(tiny_gguf, reqs)
    stepped = [i for i, (kind, _, ids) in enumerate(log) if kind == "stepped" and ids]
    assert len(stepped) >= 6
    for i in stepped:
        n, ids = log[i][1], log[i][2]
        handed = next(j for j in range(i + 1, len(log)) if log[j][0] == "handed" and log[j][2])
        assert log[handed][2] == ids  # the step's outputs, whole and in order
        following = [j for j, (kind, m, _) in enumerate(log) if kind == "launched" and m == n + 1]
        assert following and following[0] < handed or not following and log[-1][0] == "handed"


async def test_bad_request_raises_from_the_iterator_and_the_engine_goes_on(engine: AsyncEngine) -> None:
    too_long = request(engine, "long", params=SamplingParams(max_tokens=200, temperature=0))
    with pytest.raises(RequestError) as info:
        await collect(engine, too_long)
    assert info.value.code == "context_length_exceeded" and "128" in str(info.value)
    assert (await collect(engine, request(engine, "ok")))[-1].finish_reason == "length"


async def test_a_group_is_admitted_whole_or_not_at_all(engine: AsyncEngine) -> None:
    good, bad = request(engine, "g"), Request("b", (10**7,), GREEDY)
    with pytest.raises(RequestError, match="vocabulary"):
        async with engine.open([good, bad]):
            pass
    await wait_for(lambda: engine.num_pending == 0)
    assert engine.stats().stats.num_running == 0 and engine.stats().stats.num_waiting == 0


async def test_cancelled_while_waiting_for_admission_leaves_nothing_behind(engine: AsyncEngine) -> None:
    long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    for req in (Request("bad", (10**7,), GREEDY), request(engine, "good", params=long)):
        task = asyncio.create_task(collect(engine, req))
        await asyncio.sleep(0)  # the add is queued; the engine thread has not answered yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await wait_for(lambda: engine.num_pending == 0 and engine.num_running == 0)


async def test_duplicate_request_id_is_rejected(engine: AsyncEngine) -> None:
    long = request(engine, "dup", params=SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    async with engine.open([long]) as stream:
        with pytest.raises(RequestError, match="already running"):
            await collect(engine, request(engine, "dup"))
        await anext(stream)


async def test_closing_the_iterator_aborts_and_frees_the_slot(engine: AsyncEngine) -> None:
    long = request(engine, "long", params=SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    async with aclosing(engine.generate(long)) as outputs:
        async for _ in outputs:
            assert engine.num_pending == 1
            break
    await wait_for(lambda: engine.num_pending == 0 and engine.num_running == 0)


async def test_abort_ends_the_stream_with_finish_reason_abort(engine: AsyncEngine) -> None:
    long = request(engine, "a", params=SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    outs = []
    async for out in engine.generate(long):
        outs.append(out)
        if len(outs) == 2:
            engine.abort("a")
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert 2 <= outs[-1].num_generated_tokens < 100


async def test_drain_aborts_what_outlives_the_timeout(engine: AsyncEngine) -> None:
    long = request(engine, "d", params=SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    outputs = engine.generate(long)
    first = await anext(outputs)
    aborted, rest = await asyncio.gather(engine.drain(timeout=0), _drain_rest(outputs))
    assert not first.finished and aborted == 1 and rest[-1].finish_reason == "abort"
    with pytest.raises(EngineUnavailableError, match="shutting down"):
        await collect(engine, request(engine, "late"))


async def _drain_rest(outputs: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [out async for out in outputs]


async def test_drain_lets_requests_finish_within_the_timeout(engine: AsyncEngine) -> None:
    task = asyncio.create_task(collect(engine, request(engine, "f")))
    await wait_for(lambda: engine.num_pending == 1)
    assert await engine.drain(timeout=60) == 0
    assert (await task)[-1].finish_reason == "length"


async def test_finish_metrics_report_the_timings(tiny_gguf: Path) -> None:
    seen: list[RequestMetrics] = []
    eng = AsyncEngine(config(tiny_gguf), on_finish=seen.append)
    await eng.start()
    outs = await collect(eng, request(eng, "m"))
    await eng.shutdown()
    (m,) = seen
    assert m.request_id == "m" and m.finish_reason == "length" and m.num_generated_tokens == 6
    assert m.num_prompt_tokens == outs[-1].num_prompt_tokens > 0
    assert len(m.inter_token_latencies) == 5 and all(gap >= 0 for gap in m.inter_token_latencies)
    assert m.time_to_first_token is not None
    assert 0 <= m.queue_time <= m.time_to_first_token <= m.e2e_latency


async def test_the_event_loop_keeps_running_during_steps(engine: AsyncEngine) -> None:
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    task = asyncio.create_task(ticker())
    long = request(engine, "t", "word " * 80, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    await collect(engine, long)
    task.cancel()
    steps = engine.stats().stats.steps
    assert ticks > 10 * steps  # a loop that ran the steps itself would tick about once per step


async def test_engine_failure_reaches_every_request_and_health(tiny_gguf: Path) -> None:
    llm = LLMEngine(config(tiny_gguf))
    forward = llm.model.forward
    calls = 0

    def failing_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls > 3:
            raise RuntimeError("device lost")
        return forward(*args, **kwargs)

    llm.model.forward = failing_forward  # type: ignore[method-assign]  # a device that fails mid-run
    eng = AsyncEngine.from_engine(llm)
    await eng.start()
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    results = await asyncio.gather(*(collect(eng, request(eng, f"x{i}", params=params)) for i in range(3)),
                                   return_exceptions=True)
    assert all(isinstance(r, EngineDeadError) and "device lost" in str(r) for r in results)
    assert eng.is_dead and not eng.is_ready and eng.num_pending == 0
    with pytest.raises(EngineDeadError):
        await collect(eng, Request("after", (1, 2), GREEDY))
    await eng.shutdown()


async def test_a_failure_comes_after_the_outputs_of_the_steps_before_it(tiny_gguf: Path) -> None:
    """With a step's outputs held until the next launch (CUDA), the last good step's still reach the stream."""
    llm = LLMEngine(config(tiny_gguf))
    llm.launches_async = True
    forward, calls = llm.model.forward, 0

    def failing_forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls > 4:  # the prompt's step and three decode steps
            raise RuntimeError("device lost")
        return forward(*args, **kwargs)

    llm.model.forward = failing_forward  # type: ignore[method-assign]
    eng = AsyncEngine.from_engine(llm)
    await eng.start()
    received: list[RequestOutput] = []
    with pytest.raises(EngineDeadError, match="device lost"):
        async for out in eng.generate(request(eng, "x", params=SamplingParams(max_tokens=50, temperature=0,
                                                                            ignore_eos=True))):
            received.append(out)
    assert sum(len(o.new_token_ids) for o in received) == 4  # one token from each step that ran
    await eng.shutdown()


async def test_shutdown_closes_the_engine_and_logs_the_cache_summary(
        tiny_gguf: Path, caplog: pytest.LogCaptureFixture) -> None:
    eng = AsyncEngine(config(tiny_gguf))
    await eng.start()
    with caplog.at_level(logging.INFO, logger="engine.llm_engine"):
        await eng.shutdown()
    assert any("expert cache, batches" in r.getMessage() for r in caplog.records)
    assert not eng.is_accepting


async def test_a_consumer_that_fell_behind_reads_one_output_per_request() -> None:
    stream = RequestStream([Request("a-0", (1,), GREEDY), Request("a-1", (1,), GREEDY)], arrival=0.0)
    steps = [RequestOutput("a-0", (5,), "x"), RequestOutput("a-1", (6,), "p"), RequestOutput("a-0", (7,), "y"),
             RequestOutput("a-0", (8,), "z", finished=True, finish_reason="length", num_generated_tokens=3)]
    for out in steps:
        stream.deliver(out, at=0.0)
    first, second = await anext(stream), await anext(stream)
    assert (first.request_id, first.new_token_ids, first.new_text) == ("a-0", (5, 7, 8), "xyz")
    assert first.finished and first.finish_reason == "length" and first.num_generated_tokens == 3
    assert (second.request_id, second.new_token_ids, second.finished) == ("a-1", (6,), False)
    stream.deliver(RequestOutput("a-1", (9,), "q", finished=True), at=0.0)
    assert [o.new_token_ids async for o in stream] == [(9,)]


def test_outputs_before_an_error_are_kept_and_the_error_comes_last() -> None:
    error = EngineDeadError("gone")
    merged = coalesce([RequestOutput("r", (1,), "a"), RequestOutput("r", (2,), "b"), error,
                       RequestOutput("r", (3,), "c")])
    assert merged == [RequestOutput("r", (1, 2), "ab"), error]


def test_a_bad_gil_switch_interval_is_named() -> None:
    from engine.async_engine import _gil_switch_s

    assert _gil_switch_s("0.5") == 0.0005
    for bad in ("abc", "0", "-1", "nan"):
        with pytest.raises(ValueError, match="MOECACHE_GIL_SWITCH_MS"):
            _gil_switch_s(bad)
