"""Continuous batching without torch: decode first, chunked prefill, slots freed at once."""

from __future__ import annotations

import pytest

from engine.config import SchedulerConfig
from engine.scheduler import FED, Scheduler
from engine.types import Request, RequestError, SamplingParams


def req(rid: str, n: int) -> Request:
    return Request(rid, tuple(range(1, n + 1)))


def run_step(s: Scheduler, next_token: int = 7) -> dict[str, tuple]:
    out = s.schedule()
    by_id = {seq.request_id: seq for seq in out.seqs}
    for seq in s.running:
        if seq.request_id in by_id and by_id[seq.request_id].samples:
            s.append_token(seq.request_id, next_token)
    return {k: (v.start, len(v.token_ids), v.samples) for k, v in by_id.items()}


def test_prompt_then_decode() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16))
    s.add(req("a", 5))
    assert run_step(s) == {"a": (0, 5, True)}
    assert run_step(s) == {"a": (5, 1, True)}
    assert run_step(s) == {"a": (6, 1, True)}


def test_long_prompt_is_chunked_and_decoders_go_first() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8))
    s.add(req("a", 3))
    run_step(s)
    s.add(req("b", 20))
    assert run_step(s) == {"a": (3, 1, True), "b": (0, 7, False)}
    assert run_step(s) == {"a": (4, 1, True), "b": (7, 7, False)}
    assert run_step(s) == {"a": (5, 1, True), "b": (14, 6, True)}
    assert run_step(s) == {"a": (6, 1, True), "b": (20, 1, True)}


def test_slots_limit_admission_and_are_freed_at_once() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64))
    for rid in "abc":
        s.add(req(rid, 4))
    first = run_step(s)
    assert set(first) == {"a", "b"} and s.num_waiting == 1
    slot_a = next(q.slot for q in s.running if q.request_id == "a")
    s.abort("a")
    out = s.schedule()
    assert "a" in out.finished_ids
    c = next(q for q in s.running if q.request_id == "c")
    assert c.slot == slot_a and {q.request_id for q in out.seqs} == {"b", "c"}


def test_finish_releases_slot_and_kv_usage() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, max_model_len=100))
    seq = s.add(req("a", 4))
    run_step(s)
    assert s.kv_usage() == 5 / 100
    s.finish(seq.request_id)
    assert s.free_slots == [0] and s.kv_usage() == 0 and not s.has_unfinished()


def test_abort_waiting_request() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8))
    s.add(req("a", 4))
    s.add(req("b", 4))
    run_step(s)
    assert s.abort("b") is not None and s.num_waiting == 0
    assert s.abort("zzz") is None


def test_the_scheduler_decides_when_a_token_ends_a_sequence() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=16, max_model_len=8))
    s.add(Request("stop", (1, 2), SamplingParams(max_tokens=5)), stop_ids=frozenset({9}))
    s.add(Request("limit", (1, 2), SamplingParams(max_tokens=2)))
    s.add(Request("context", (1, 2, 3, 4, 5, 6), SamplingParams(max_tokens=5)))
    s.schedule()
    assert [s.append_token("stop", t) for t in (3, 9)] == [None, "stop"]
    assert [s.append_token("limit", t) for t in (3, 4)] == [None, "length"]
    assert [s.append_token("context", t) for t in (7, 8)] == [None, "length"]  # 8 positions
    assert s.num_running == 3  # they end when the engine finishes them
    for rid in ("stop", "limit", "context"):
        s.finish(rid)
    assert not s.has_unfinished() and set(s.schedule().finished_ids) == {"stop", "limit", "context"}


def test_a_running_id_is_refused() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8))
    s.add(req("a", 4))
    with pytest.raises(RequestError, match="'a' is already running"):
        s.add(req("a", 2))
    s.finish("a")
    s.add(req("a", 2))  # an ended id may come back
    assert s.is_waiting("a") and not s.is_waiting("zzz")


def test_prompts_beside_running_decodes_take_at_most_their_share_of_a_step() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_while_decoding=6))
    s.add(req("a", 3))
    assert run_step(s) == {"a": (0, 3, True)}  # nothing decodes yet: the whole budget
    s.add(req("b", 20))
    s.add(req("c", 4))
    assert run_step(s) == {"a": (3, 1, True), "b": (0, 6, False)}
    assert run_step(s) == {"a": (4, 1, True), "b": (6, 6, False)}
    s.abort("a")
    assert run_step(s) == {"b": (12, 8, True), "c": (0, 4, True)}  # no decode waits: up to the step's budget
    unlimited = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))  # the default: the budget
    unlimited.add(req("a", 3))
    run_step(unlimited)
    unlimited.add(req("b", 20))
    assert run_step(unlimited) == {"a": (3, 1, True), "b": (0, 20, True)}
    with pytest.raises(ValueError, match="prefill_while_decoding"):
        SchedulerConfig(prefill_while_decoding=-1)


def test_a_step_scheduled_ahead_decodes_the_same_sequences_before_their_tokens_are_known() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64))
    s.add(Request("a", (1, 2, 3), SamplingParams(max_tokens=5)))
    s.add(Request("b", (4, 5), SamplingParams(max_tokens=1)))
    assert not s.can_schedule_ahead()  # nothing runs yet
    s.schedule()  # both prompts whole: each awaits its first token
    assert s.can_schedule_ahead()
    ahead = s.schedule_ahead()  # b's first token ends it (its limit): only a decodes ahead, at position 3
    assert [(q.request_id, q.start, q.token_ids, q.samples) for q in ahead.seqs] == [("a", 3, (FED,), True)]
    assert not s.can_schedule_ahead()  # the prompt step's tokens are not appended yet
    assert s.append_token("a", 9) is None and s.append_token("b", 8) == "length"
    s.finish("b")
    assert s.can_schedule_ahead()  # a awaits the token of the step ahead: the next one can go ahead too
    second = s.schedule_ahead()
    assert second.finished_ids == ("b",) and [(q.start, q.token_ids) for q in second.seqs] == [(4, (FED,))]
    s.append_token("a", 10)
    s.append_token("a", 11)  # the tokens of both steps ahead read: a decodes in turn again, 11 at position 5
    assert not s.can_schedule_ahead() and run_step(s) == {"a": (5, 1, True)}


def test_no_step_ahead_while_a_prompt_prefills_or_can_take_a_free_slot() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=4))
    s.add(req("a", 2))
    s.schedule()
    assert s.can_schedule_ahead()
    s.add(req("b", 9))  # waits, and a slot is free
    assert not s.can_schedule_ahead()
    s.append_token("a", 7)
    s.schedule()  # a decodes, b's first chunk (3 tokens) prefills
    assert not s.can_schedule_ahead()  # b prefills
    s.add(req("c", 2))  # waits, and no slot is free
    while s.requests["b"].num_computed < s.requests["b"].num_tokens:
        s.append_token("a", 7)
        s.schedule()
    assert s.num_waiting == 1 and s.can_schedule_ahead()  # a and b await their tokens; c's wait takes no slot
