"""The hybrid split: the (share, lead) rule that gives layers of each number of misses about their best split
between the link and the CPU (the CPU task's fixed cost, host memory shared by both, the later misses of experts
the CPU computed), the CPU's rate re-measured from its tasks' counters, the search that times candidate splits on
the decode steps in rounds (each step charged the later misses of the CPU's experts) and keeps the fastest, and
when hybrid uploads what the CPU computed."""

from __future__ import annotations

import itertools
import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from engine.config import MissMode
from engine.expert_cache.cpu_tasks import CpuWork
from engine.expert_cache.split import (
    LinkLoad,
    Split,
    SplitSearch,
    best_split,
    later_misses_of,
    layer_seconds,
    streamed_of,
)
from ops.bank import ExpertWeights, random_expert_weights
from ops.quants import QType


@pytest.fixture(scope="module")
def bank():  # noqa: ANN201
    return random_expert_weights(8, 256, 256, QType.Q4_K)


def test_stream_and_cpu_modes_send_every_miss_one_way(bank) -> None:  # noqa: ANN001
    assert Split(MissMode("stream"), torch.device("cpu"), [bank], False).share == 1.0
    assert Split(MissMode("cpu"), torch.device("cpu"), [bank], False).share == 0.0


def test_the_model_split_follows_the_measured_cpu_rate(bank) -> None:  # noqa: ANN001
    split = Split(MissMode("hybrid"), torch.device("cpu"), [bank], False, every=4)
    assert 0.0 < split.share < 1.0 and split.link_gbps > 0 and split.cpu_gbps > 0
    assert (split.share, split.lead) == split.model and split.search is not None
    split.link_gbps = 10.0
    work = CpuWork()
    for _ in range(12):  # the CPU reads 30 GB/s: the model streams about 10 / (10 + 30) of the misses
        work = CpuWork(work.calls + 1, 0, 0, work.bytes + 30_000_000, work.busy_seconds + 0.001)
        split.update(work, 0.01)
    model = best_split(bank.expert_bytes, 10e9, 30e9, 0.0, None, 8)
    assert split.model == model and model[0] == pytest.approx(0.25, abs=0.06) and split.cpu_gbps == pytest.approx(30.0)


def test_a_new_search_starts_from_the_running_split_with_the_models_among_the_others(bank) -> None:  # noqa: ANN001
    split = Split(MissMode("hybrid"), torch.device("cpu"), [bank], False, research=120)
    first = split.model
    seconds = lambda: 1e-3 if split.share == 0.0 else 2e-3  # noqa: E731  every miss on the CPU is fastest
    ran = []
    for _ in range(100):
        split.update(CpuWork(), seconds())
        ran.append((split.share, split.lead))
    assert split.search is not None and split.search.is_done and ran[-1] == (0.0, 0.0)
    assert ran.count(first) <= 12  # the model's split timed (3 turns of 4 steps), not kept
    split.model = (0.5, 0.5)  # as the CPU's re-measured rate would move it
    seconds = lambda: 1.5e-3 if split.share == 0.0 else 2e-3  # noqa: E731  the running split's steps slower now
    for _ in range(100):  # the search of step 120, the next one not before step 240
        split.update(CpuWork(), seconds())
    assert split.search.is_done and set(split.search.times) >= {(0.5, 0.5), (0.1, 0.0)}
    assert (1.0, 0.0) not in split.search.times  # a later search is local: the far end is not run again
    assert (split.share, split.lead) == (0.0, 0.0)


def test_a_later_search_times_the_running_split_its_neighbours_and_the_models_only() -> None:
    search = SplitSearch((1.0, 0.0), [(0.94, 0.0)], local=True)
    ran = drive(search, lambda split: 1e-3 * (1 + (1 - split[0])), 200)  # streaming every miss is fastest
    assert set(ran) == {(1.0, 0.0), (0.94, 0.0), (0.9, 0.0)} and search.is_done and search.best == (1.0, 0.0)
    assert len(ran) - ran[::-1].index((0.9, 0.0)) <= 36  # one phase of 3 candidates, then every miss streamed


def drive(search: SplitSearch, seconds_of, steps: int) -> list[tuple[float, float]]:  # noqa: ANN001
    """The engine's order: a step's seconds reach the search while the next step runs; a split it returns runs from
    the step after. Returns the split each step ran."""
    ran, running, before = [], search.best, search.best
    for _ in range(steps):
        following = search.observe(seconds_of(before))
        ran.append(running)
        before = running
        if following is not None:
            running = following
    return ran


def test_the_search_keeps_the_fastest_split_timed() -> None:
    """The model says 0.62; the steps are fastest at share 0.3 (1 ms a token, +1 ms per unit of share away)."""
    search = SplitSearch((0.62, 0.35))
    ran = drive(search, lambda split: 1e-3 * (1 + abs(split[0] - 0.3)), 200)
    assert search.is_done and search.best == (0.3, 0.0) and ran[-1] == (0.3, 0.0)
    assert search.times[(0.62, 0.35)] == pytest.approx(1.32e-3)  # each timed on its own steps, not the one before
    assert search.times[(0.3, 0.0)] == pytest.approx(1e-3)
    # 12 steps a candidate a phase: the prior and both ends (36), then 0 beside 0.1, 0.1 beside 0.2 (24 each)
    assert 84 < ran.index((0.3, 0.0)) < 90


def test_a_phases_candidates_take_turns_in_rounds() -> None:
    search = SplitSearch((0.5, 0.0), rounds=3, steps_per_round=2, settle=2)
    ran = drive(search, lambda split: 1e-3 * (1 + abs(split[0] - 0.5)), 36)
    turns = [split for split, _ in itertools.groupby(ran)]
    assert turns == [(0.5, 0.0), (0.0, 0.0), (1.0, 0.0)] * 3  # the prior first: it ran when the search began
    assert [len(list(steps)) for _, steps in itertools.groupby(ran)] == [4] * 9  # settle 2 + 2 timed a turn


def drifting(seconds: dict[tuple[float, float], float], drift: float, over: int):  # noqa: ANN201
    """A clock of decode steps that drift down by `drift` over the first `over` steps (a warming cache): step t of
    split c takes seconds[c] x (1 + drift x (1 - t / over))."""
    steps = itertools.count()
    return lambda split: seconds[split] * (1 + drift * max(0.0, 1 - next(steps) / over))


def contiguous_choice(order: list[tuple[float, float]], clock, settle: int = 2, steps: int = 4):  # noqa: ANN001, ANN201
    """The fastest of `order` timed one after another, `settle` + `steps` steps each (medians)."""
    times = {}
    for split in order:
        seen = [clock(split) for _ in range(settle + steps)][settle:]
        times[split] = sorted(seen)[steps // 2]
    return min(times, key=times.__getitem__)


def test_a_drifting_clock_does_not_favour_a_candidate_timed_later() -> None:
    """A new search from all-stream, 3% faster than the model's split at equal time, while the steps drift 10% down:
    timed in one block each, the model's split (timed after all-stream) would look faster; in rounds, all-stream
    stays, however long the drift."""
    seconds = {(1.0, 0.0): 1e-3, (0.5, 0.35): 1.03e-3, (0.0, 0.0): 1.3e-3, (0.9, 0.0): 1.02e-3}
    order = [(1.0, 0.0), (0.5, 0.35), (0.0, 0.0)]
    assert contiguous_choice(order, drifting(seconds, 0.1, over=18)) == (0.5, 0.35)  # 18: 3 blocks of 6 steps
    for over in (6, 12, 18, 36, 72):
        search = SplitSearch((1.0, 0.0), [(0.5, 0.35)])
        drive(search, drifting(seconds, 0.1, over), 200)
        assert search.is_done and search.best == (1.0, 0.0), over


def test_the_search_ends_and_finds_the_true_best_among_shares_a_tenth_apart() -> None:
    """Noise-free (the ends 0.3 ms slower): from the model's 0.48/0.35 down to the fastest, 0.18/0.35. Noisy: it
    still ends, each neighbour phase timing an untimed split: the first phase's 4 candidates, then 2 or 3 a phase
    for at most the 10 shares 0.08..0.98 of its lead."""
    search = SplitSearch((0.48, 0.35), [(0.68, 0.35)])
    ran = drive(search, lambda split: 1e-3 * (1 + abs(split[0] - 0.18) + 0.3 * (split[1] == 0)), 300)
    assert search.is_done and search.best == ran[-1] == (0.18, 0.35)
    assert {(0.28, 0.35), (0.08, 0.35)} <= set(search.times)
    bound = 4 * 12 + 10 * 3 * 12
    rng = np.random.default_rng(0)
    for _ in range(20):
        search = SplitSearch((0.48, 0.35), [(0.68, 0.35)])
        drive(search, lambda split: 1e-3 * rng.uniform(1, 1.5), bound)
        assert search.is_done and len(search.times) <= 14


def test_the_cpus_experts_are_charged_their_later_misses(bank) -> None:  # noqa: ANN001
    """Every miss on the CPU is 2% faster on the clock than every miss streamed, but its 500 kB a step of experts
    that do not land each cost a later miss: 50 us at 10 GB/s, 5% of a 1 ms step. With a cache (1 later miss an
    expert) all-stream is kept; without one the CPU's split."""
    def search(later_misses: float) -> SplitSearch:
        split = Split(MissMode("hybrid"), torch.device("cpu"), [bank], False)
        split.link_gbps, split.later_misses = 10.0, later_misses
        split.share, split.lead = 1.0, 0.0
        split.search = SplitSearch((1.0, 0.0))
        work = CpuWork()
        for _ in range(100):
            work = replace(work, bytes=work.bytes + int((1 - split.share) * 500_000))
            split.update(work, {1.0: 1e-3, 0.0: 0.98e-3}.get(split.share, 1.1e-3))
        assert split.search.is_done
        return split.search

    charged, free = search(1.0), search(0.0)
    assert charged.best == (1.0, 0.0) and charged.times[(0.0, 0.0)] == pytest.approx(1.03e-3)
    assert free.best == (0.0, 0.0) and free.times[(0.0, 0.0)] == pytest.approx(0.98e-3)


def test_a_step_of_several_tokens_is_charged_its_later_misses_per_token(bank) -> None:  # noqa: ANN001
    split = Split(MissMode("hybrid"), torch.device("cpu"), [bank], False)
    split.link_gbps, split.later_misses = 10.0, 1.0
    split.search = SplitSearch((1.0, 0.0), rounds=1, steps_per_round=1, settle=0)
    split.update(CpuWork(bytes=4_000_000), 1e-3)  # no step before: nothing to charge
    split.update(CpuWork(bytes=5_000_000), 1e-3, num_tokens=2)  # 1 MB at 10 GB/s: 100 us, 50 a token
    assert split.search.times == {(1.0, 0.0): pytest.approx(1e-3), (0.0, 0.0): pytest.approx(1.05e-3)}


def test_the_search_keeps_the_prior_where_it_is_fastest_and_ignores_a_slow_step() -> None:
    search = SplitSearch((0.5, 0.0))
    steps = iter(range(1000))

    def seconds_of(split: tuple[float, float]) -> float:
        slow = next(steps) == 9  # one step of another's split slowed by a prompt joining
        return 1e-3 * (1 + abs(split[0] - 0.5)) * (5 if slow else 1)

    ran = drive(search, seconds_of, 80)
    assert search.is_done and search.best == (0.5, 0.0) and ran[-1] == (0.5, 0.0)
    assert set(search.times) == {(0.5, 0.0), (0.0, 0.0), (1.0, 0.0), (0.4, 0.0), (0.6, 0.0)}


def rule_seconds(share: float, lead: float, n: int, *args) -> float:  # noqa: ANN002
    return float(layer_seconds(streamed_of(share, lead, n), np.int64(n), *args))


def best_seconds(n: int, *args) -> float:  # noqa: ANN002
    return min(float(layer_seconds(np.int64(s), np.int64(n), *args)) for s in range(n + 1))


def test_the_rule_gives_each_number_of_misses_about_its_best_split() -> None:
    args = (3_000_000, 50e9, 75e9, 30e-6)  # 60 us an expert streamed, 40 on the CPU after its 30 us
    share, lead = best_split(*args, None, 8)
    assert streamed_of(share, lead, 1) == 1  # 60 us streamed, 70 on the CPU
    assert streamed_of(share, lead, 2) == 1  # one each way: 70 us, where streaming both takes 120
    for n in range(1, 9):
        assert rule_seconds(share, lead, n, *args) <= 1.1 * best_seconds(n, *args), n


def test_host_memory_that_feeds_both_no_faster_than_the_link_streams_every_miss() -> None:
    """At once the link and the CPU read 25 GB/s each, no more than the link's 50 alone: the CPU only adds its fixed
    cost."""
    share, lead = best_split(3_000_000, 50e9, 50e9, 30e-6, (25e9, 25e9), 8)
    assert all(streamed_of(share, lead, n) == n for n in range(1, 9))
    share, lead = best_split(3_000_000, 50e9, 50e9, 30e-6, (40e9, 40e9), 8)  # 80 GB/s at once: split many
    assert streamed_of(share, lead, 8) < 8


def test_the_cpu_takes_fewer_misses_the_more_each_costs_later() -> None:
    """An expert the CPU computes does not land: about one later miss at a 50% cache, 0.2 at 25%, none without."""
    assert (later_misses_of(0.0), later_misses_of(0.25), later_misses_of(0.5)) == \
        (0.0, pytest.approx(1 / 6), 1.0)
    args = (2_654_208, 45e9, 55e9, 28e-6, (31e9, 26e9), 8)  # measured on the H200 host (docs/benchmarks.md)
    on_cpu = [sum(n - int(streamed_of(*best_split(*args, later_misses_of(f)), n)) for n in range(1, 9))
              for f in (0.0, 0.25, 0.5)]
    assert on_cpu[0] >= on_cpu[1] >= on_cpu[2] == 0 and on_cpu[0] > 0


def test_hybrid_uploads_the_cpus_misses_only_while_the_link_is_mostly_idle(bank) -> None:  # noqa: ANN001
    split = Split(MissMode("hybrid"), torch.device("cpu"), [bank], False)
    split.link = LinkLoad(50.0, steps=4)
    assert split.uploads_cpu_misses  # nothing streamed yet
    for _ in range(20):  # 42 MB a 5 ms step at 50 GB/s: the link busy 17% of the time
        split.link.add(42_000_000, 0.005)
    assert split.link.busy == pytest.approx(0.168) and split.uploads_cpu_misses
    for _ in range(20):  # 140 MB a 8 ms step: 35%
        split.link.add(140_000_000, 0.008)
    assert split.link.busy == pytest.approx(0.35, abs=0.01) and not split.uploads_cpu_misses
    stream = Split(MissMode("stream"), torch.device("cpu"), [bank], False)
    assert not stream.uploads_cpu_misses  # a streamed miss lands: nothing the CPU computed to upload


@pytest.mark.gpu
def test_at_once_neither_the_link_nor_the_cpu_reads_faster_than_alone() -> None:
    """The at-once rates are taken while both read host memory: neither beats its own rate alone (a CPU figure
    taken partly alone once read 58.7 GB/s at once beside 41.3 alone). A measurement: on a quiet host
    (.ci/gpu-final.sh runs it after the other gpu tests, alone)."""
    from engine.expert_cache.split import measure_cpu_gbps, measure_shared_gbps, measure_stream_gbps

    def pinned(seed: int) -> ExpertWeights:  # one layer of Qwen3-30B-A3B's Q4_K experts
        torch.manual_seed(seed)
        w = random_expert_weights(128, 2048, 768, QType.Q4_K)
        return replace(w, gate=w.gate.pin_memory(), up=w.up.pin_memory(), down=w.down.pin_memory())

    device, threads = torch.device("cuda"), max(1, (os.cpu_count() or 2) - 2)
    link_bank, cpu_bank = pinned(0), pinned(1)

    def alone() -> tuple[float, float]:
        return measure_stream_gbps(link_bank, device), measure_cpu_gbps(cpu_bank, num_threads=threads)

    before = alone()
    link_both, cpu_both = measure_shared_gbps(link_bank, cpu_bank, device, threads)
    link, cpu = (max(a, b) for a, b in zip(before, alone()))  # alone before and after: a host that got busier
    assert 0 < link_both <= 1.15 * link and 0 < cpu_both <= 1.15 * cpu


@pytest.mark.parametrize(("gain", "kept"), [(0.02, (1.0, 0.0)), (0.08, (0.5, 0.0))])
def test_a_split_must_beat_the_reference_by_the_margin(gain: float, kept: tuple[float, float]) -> None:
    """Every miss streamed is the reference (a cache holds experts): the model's 0.5 kept only when clearly faster."""
    seconds = {(1.0, 0.0): 1e-3, (0.0, 0.0): 1.5e-3}
    search = SplitSearch((0.5, 0.0), reference=(1.0, 0.0), margin=0.03)
    ran = drive(search, lambda split: seconds.get(split, 1e-3 * (1 - gain + abs(split[0] - 0.5))), 300)
    assert search.is_done and search.best == kept and ran[-1] == kept


@pytest.mark.parametrize("moved", [0.0, 0.03, 0.2])
def test_no_new_search_while_the_running_split_takes_the_time_it_was_searched_at(bank, moved: float) -> None:  # noqa: ANN001
    """A search runs other splits for some of its steps: at the next search's step, one starts only where the
    running split's steps have moved from its searched time by more than RESEARCH_DRIFT (5%)."""
    split = Split(MissMode("hybrid"), torch.device("cpu"), [bank], False, cached_share=0.25, research=120)
    slower = lambda: 1.0 if split.share == 1.0 else 1.3  # noqa: E731  streaming every miss is fastest
    for _ in range(100):
        split.update(CpuWork(), 1e-3 * slower())
    first = split.search
    assert first is not None and first.is_done and (split.share, split.lead) == (1.0, 0.0)
    ran = []
    for _ in range(60):  # the next search's step (120) in the middle
        split.update(CpuWork(), 1e-3 * (1 + moved) * slower())
        ran.append((split.share, split.lead))
    if moved > 0.05:
        assert split.search is not first and any(r != (1.0, 0.0) for r in ran)
    else:
        assert split.search is first and set(ran) == {(1.0, 0.0)}


def test_with_a_cache_hybrid_streams_every_miss_unless_a_split_is_clearly_faster(bank) -> None:  # noqa: ANN001
    cached = Split(MissMode("hybrid"), torch.device("cpu"), [bank], False, cached_share=0.25)
    assert cached.search is not None and cached.search.reference == (1.0, 0.0)
    assert Split(MissMode("hybrid"), torch.device("cpu"), [bank], False).search.reference is None
