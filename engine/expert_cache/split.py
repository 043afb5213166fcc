"""How `hybrid` mode splits a layer's missed experts between the device (copying them from pinned host
memory, `ops.triton.stage`) and the CPU: the device streams the first `round(share x n + lead)` of a layer's n
missed experts, in pair order (`ops.cache_step`), the CPU computes the rest.

(share, lead) is fit to a model of a layer's time (`layer_seconds`): s streamed experts of B bytes take s B / link,
the CPU's take c + (n - s) B / cpu (c: the fixed cost of the layer's CPU task, as the device waits for it), and a
layer with both at work waits for the slower. Both paths read the same host memory; where it cannot feed both at
their own rates (on the H200 host: link 42 + CPU 55 GB/s alone, 30 + 26 at once), each runs at its measured
at-once rate while the other works. An expert the CPU computes does not land, so it also costs the later misses
it causes (`later_misses_of`). `best_split` picks the (share, lead) whose rule gives layers of 1..top-k misses the
least time in all: a layer with few misses streams them all, and where the CPU's work does not pay (host memory
that feeds both no faster than the link alone, or a large cache) every miss is streamed.

The model is the prior, the clock the judge: the rates it is fit to are measured apart from the steps (on the H200
host the at-once rates read 43 + 42 GB/s in one run and 35 + 32 in the next), so `SplitSearch` times the model's
split, every miss on the CPU and every miss streamed on decode steps, then the fastest's neighbours (shares 0.1
either side) beside the fastest while one beats it, and keeps the fastest. A phase's candidates take turns of a few
steps for a few rounds, so a cache still warming or routing that drifts weighs on them alike (timed in one block
each, a candidate timed later looks faster); a candidate's time is the median of its timed steps (medians of 6 steps
differ by a few % from noise alone). The later misses of the CPU's experts come after the few steps a candidate
runs, so where the cache holds experts each step is charged them before the search sees it: `later_misses_of` x the
bytes the CPU computed in the step (its counters, `CpuWork.bytes`) / the link's rate. The engine re-measures the CPU
as it runs (`CpuTasks.work`) and refits the model; after `FIRST_RESEARCH` decode steps (the first search ran while a
cache was filling), then every `Split.research`, a new search starts from the split running then, with the model's
split among the candidates, where the running split's steps have moved from the time the last search gave it by
more than `RESEARCH_DRIFT`: a search runs worse splits for some of its steps, which a search that finds what runs
only costs (at 25% and 50% caches, where every search kept streaming every miss, hybrid ran 2% behind stream: H100,
2026-12-07)."""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.config import MissMode
from engine.expert_cache.cpu_tasks import CpuTasks, CpuWork
from engine.expert_cache.device import empty_bank
from ops.bank import ExpertWeights
from ops.cpu_experts import expert_ffn_cpu


def _seconds(fn: Callable[[], None], repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def measure_link_gbps(device: torch.device, num_bytes: int = 64 << 20) -> float:
    """Pinned host -> device copy speed (a host memory copy when the device is the CPU)."""
    pin = device.type == "cuda"
    src = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=device)

    def copy() -> None:
        dst.copy_(src, non_blocking=pin)
        if pin:
            torch.cuda.synchronize(device)

    return num_bytes / _seconds(copy) / 1e9


def _streamer(bank: ExpertWeights, device: torch.device) -> Callable[[int], None]:
    """`stream(r)`: the device copies round r's 8 experts of `bank` (cycling through all of them, so they come
    from host memory, not a cache) into VRAM inside the grouped FFN's kernels and computes them, as a decode
    step computes streamed misses."""
    from ops.triton import ExpertTables, Fill, grouped_expert_ffn, tables_from_bank

    n, k = bank.num_experts, min(8, bank.num_experts)
    plain = ExpertWeights(bank.gate, bank.up, bank.down, bank.gate_type, bank.up_type, bank.down_type, bank.hidden,
                          bank.ff)  # plain math: the copy speed is measured
    src, vram = tables_from_bank(plain, device), tables_from_bank(empty_bank(plain, k, device), device)
    row = torch.arange(n, device=device) % k  # expert e lands in VRAM row e % k: a round's k experts apart
    dst = ExpertTables(vram.gate_ptrs[row], vram.up_ptrs[row], vram.down_ptrs[row], plain.gate_type, plain.up_type,
                       plain.down_type, plain.hidden, plain.ff)
    fill = Fill(torch.ones(n, dtype=torch.int8, device=device), src)
    x = torch.randn(1, bank.hidden, device=device, dtype=torch.bfloat16)
    tokens, weights = torch.zeros(k, dtype=torch.int64, device=device), torch.ones(k, device=device)
    rounds = [(torch.arange(k, device=device) + r * k) % n for r in range(-(-n // k))]

    def stream(r: int) -> None:
        grouped_expert_ffn(x, tokens, rounds[r % len(rounds)], weights, dst, fill=fill)

    return stream


def _device_gbps(stream: Callable[[int], None], rounds: int, round_bytes: int) -> float:
    """Bytes a second of `rounds` rounds of `stream`, timed on the device."""
    stream(0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for r in range(rounds):
        stream(r)
    end.record()
    end.synchronize()
    return rounds * round_bytes / (start.elapsed_time(end) / 1e3) / 1e9


def measure_stream_gbps(bank: ExpertWeights, device: torch.device, rounds: int = 32) -> float:
    """The device's own speed on missed experts, as a decode step computes them (`_streamer`), alone."""
    k = min(8, bank.num_experts)
    return _device_gbps(_streamer(bank, device), rounds, k * bank.expert_bytes)


def measure_shared_gbps(link_bank: ExpertWeights, cpu_bank: ExpertWeights, device: torch.device,
                        num_threads: int | None,
                        seconds: float = 0.1, repeats: int = 3) -> tuple[float, float]:
    """(device, CPU) expert bytes a second with both reading host memory at once: the device streams
    `link_bank`'s experts for `seconds` in a thread while the CPU kernel computes `cpu_bank`'s, 8 of one token a
    call, for 0.9 x `seconds` inside the device's run; the medians of `repeats` runs. Each side is timed over its
    own run, so neither figure holds time the other side was idle (.ci/gpu-host-share.py's pattern: 31 + 27 GB/s on
    the H200 host, run after run, where a CPU figure taken partly while the link was idle read 46.5 + 58.7)."""
    stream = _streamer(link_bank, device)
    round_bytes = min(8, link_bank.num_experts) * link_bank.expert_bytes
    compute, cpu_round_bytes = _cpu_caller(cpu_bank, num_threads)
    stream(0)
    compute(0)
    torch.cuda.synchronize(device)
    runs = []
    for _ in range(repeats):
        link: list[float] = []
        started = threading.Event()
        worker = threading.Thread(target=_device_run, args=(stream, round_bytes, device, seconds, started, link))
        worker.start()
        started.wait()
        calls, began = 0, time.perf_counter()
        while time.perf_counter() - began < 0.9 * seconds:
            compute(calls)
            calls += 1
        cpu = calls * cpu_round_bytes / (time.perf_counter() - began) / 1e9
        worker.join()
        if not link:
            raise RuntimeError("the device's streaming run beside the CPU failed")
        runs.append((link[0], cpu))
    return sorted(r[0] for r in runs)[repeats // 2], sorted(r[1] for r in runs)[repeats // 2]


def _device_run(stream: Callable[[int], None], round_bytes: int, device: torch.device, seconds: float,
                started: threading.Event, out: list[float]) -> None:
    """Appends to `out` the device's bytes a second streaming rounds for `seconds` of host time; sets `started` once
    it has begun (or failed: the caller waits for it and finds `out` empty)."""
    try:
        with torch.cuda.device(device):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            started.set()
            rounds, deadline = 0, time.perf_counter() + seconds
            while time.perf_counter() < deadline:
                for _ in range(8):
                    stream(rounds)
                    rounds += 1
                torch.cuda.current_stream(device).synchronize()
            end.record()
            end.synchronize()
            out.append(rounds * round_bytes / (begin.elapsed_time(end) / 1e3) / 1e9)
    finally:
        started.set()


def _cpu_caller(bank: ExpertWeights, num_threads: int | None,
                num_experts: int = 8) -> tuple[Callable[[int], None], int]:
    """(`compute(r)`, its bytes): the CPU expert kernel on round r's `num_experts` experts of one token, cycling
    through the bank (so they come from memory)."""
    n, k = bank.num_experts, min(num_experts, bank.num_experts)
    x = torch.randn(1, bank.hidden)
    tokens, weights = torch.zeros(k, dtype=torch.int64), torch.full((k,), 1.0 / k)

    def compute(r: int) -> None:
        expert_ffn_cpu(x, tokens, (torch.arange(k) + r * k) % n, weights, bank, num_threads=num_threads)

    return compute, k * bank.expert_bytes


def measure_cpu_gbps(bank: ExpertWeights, num_experts: int = 8, num_threads: int | None = None) -> float:
    """The CPU expert kernel's expert bytes a second, alone (`_cpu_caller`)."""
    compute, round_bytes = _cpu_caller(bank, num_threads, num_experts)
    rounds = itertools.count()
    return round_bytes / _seconds(lambda: compute(next(rounds)), repeats=9) / 1e9


def cpu_task_costs(tasks: CpuTasks, layer: int, top_k: int) -> tuple[float, float]:
    """(fixed, per expert) seconds of a layer's CPU task as the device waits for it (CUDA, a ringing device)."""
    one = tasks.device_seconds(layer, 1)
    if top_k < 2:
        return 0.0, one
    several = min(top_k, 4)
    per = max((tasks.device_seconds(layer, several) - one) / (several - 1), 1e-7)
    return max(one - per, 0.0), per


UPLOAD_LINK_BUSY = 0.25  # hybrid uploads the CPU's misses while streamed misses keep the link busier than this


class LinkLoad:
    """The share of the time the host link spends on streamed misses: their bytes over the link's measured rate,
    per second of decode steps (averages over the last ~`steps` steps)."""

    def __init__(self, link_gbps: float, steps: int = 16) -> None:
        self.link_gbps, self.decay = link_gbps, 1.0 - 1.0 / steps
        self._bytes = self._seconds = 0.0

    def add(self, streamed_bytes: int, seconds: float) -> None:
        self._bytes = self._bytes * self.decay + streamed_bytes
        self._seconds = self._seconds * self.decay + seconds

    @property
    def busy(self) -> float:
        if self._seconds <= 0 or self.link_gbps <= 0:
            return 0.0
        return self._bytes / (self.link_gbps * 1e9) / self._seconds


def layer_seconds(streamed: np.ndarray, missed: np.ndarray, expert_bytes: int, link: float, cpu: float, fixed: float,
                  at_once: tuple[float, float] | None = None, later_misses: float = 0.0) -> np.ndarray:
    """The modeled time of layers of `missed` experts with `streamed` of them on the link (rates in bytes a second,
    `fixed` the CPU task's seconds): the link alone, the CPU alone, or both at once at their shared rates
    (`at_once`; None: each at its own). An expert the CPU computes does not land: `later_misses` streamed misses
    each costs later."""
    link_both, cpu_both = at_once or (link, cpu)
    on_cpu = missed - streamed
    split = np.maximum(streamed * expert_bytes / link_both, fixed + on_cpu * expert_bytes / cpu_both)
    seconds = np.where(on_cpu <= 0, missed * expert_bytes / link,
                       np.where(streamed <= 0, fixed + missed * expert_bytes / cpu, split))
    return seconds + later_misses * np.maximum(on_cpu, 0) * expert_bytes / link


def later_misses_of(cached_share: float) -> float:
    """The later misses an expert the CPU computed (and did not land) costs, by the share of the host experts the
    cache holds: replaying bench's requests, about 1 at 50% and 0.2 at 25%
    (tests/engine/expert_cache/test_cache_replay.py); none without a cache."""
    return min(1.0, max(0.0, (cached_share - 0.2) / 0.3)) if cached_share > 0 else 0.0


def streamed_of(share: np.ndarray | float, lead: np.ndarray | float, missed: np.ndarray | int) -> np.ndarray:
    """The kernel's rule (`ops.cache_step`): round(share x misses + lead), at most the misses."""
    return np.minimum(np.floor(np.float32(share) * np.float32(missed) + np.float32(lead) + np.float32(0.5)), missed)


SHARES, LEADS = np.arange(1, 51) / 50, np.arange(0, 81) / 20  # the grid `best_split` searches


def best_split(expert_bytes: int, link: float, cpu: float, fixed: float, at_once: tuple[float, float] | None,
               max_missed: int, later_misses: float = 0.0) -> tuple[float, float]:
    """(share, lead) whose rule (`streamed_of`) gives layers of 1..max_missed misses the least modeled time in all
    (`layer_seconds`), over shares by 0.02 and leads by 0.05 (the smallest lead, then the largest share, of
    equal times)."""
    share, lead, missed = np.meshgrid(SHARES, LEADS, np.arange(1, max_missed + 1), indexing="ij")
    seconds = layer_seconds(streamed_of(share, lead, missed), missed, expert_bytes, link, cpu, fixed, at_once,
                            later_misses)
    total = seconds.sum(axis=2)  # [shares, leads]
    best = np.flatnonzero(total.T.reshape(-1) <= total.min() * (1 + 1e-9))[0]  # leads first, then shares
    i_lead, i_share = divmod(int(best), len(SHARES))
    return float(SHARES[i_share]), float(LEADS[i_lead])


class SplitSearch:
    """The fastest (share, lead) of decode steps as timed (module doc), in phases: first the prior (running when the
    search starts), the `others` (the model's split), every miss on the CPU and every miss streamed; then the
    fastest's untimed neighbours (shares `delta` either side) beside the fastest itself, while one beats it. A
    phase's candidates take turns for `rounds` rounds, each turn `settle` steps that still ran (part of) the one
    before, then `steps_per_round` timed ones; the median of a candidate's timed steps in its last phase is its time.
    `local`: a search from a split already timed (a later one) skips both ends and starts from the prior's
    neighbours, so a search of warm steps does not run (say) every miss on the CPU where streaming them is fastest.
    `reference`: a split timed in every phase that a candidate must beat by `margin` to be kept (where a cache
    holds experts, every miss streamed: the differences worth having there are a few percent, as large as the
    timing's noise). Plain Python: `observe` takes each decode step's seconds a token."""

    def __init__(self, prior: tuple[float, float], others: Sequence[tuple[float, float]] = (), rounds: int = 3,
                 steps_per_round: int = 2, settle: int = 2, delta: float = 0.1, local: bool = False,
                 reference: tuple[float, float] | None = None, margin: float = 0.03) -> None:
        self.rounds, self.steps_per_round, self.settle, self.delta = rounds, steps_per_round, settle, delta
        self.reference, self.margin = reference, margin
        self.best, self.best_seconds = prior, math.inf
        self.times: dict[tuple[float, float], float] = {}  # every candidate timed so far, in its last phase
        ends = self._neighbours(prior) if local else [(0.0, 0.0), (1.0, 0.0)]
        self._start(list(dict.fromkeys((prior, *others, *ends, *([reference] if reference else [])))))

    def _start(self, phase: list[tuple[float, float]]) -> None:
        self._phase, self._turn = phase, 0
        self._seen: list[float] = []  # the running turn's steps
        self._timed: dict[tuple[float, float], list[float]] = {c: [] for c in phase}

    @property
    def is_done(self) -> bool:
        return not self._phase

    @property
    def _current(self) -> tuple[float, float]:
        return self._phase[self._turn % len(self._phase)]

    def observe(self, seconds_per_token: float) -> tuple[float, float] | None:
        """A decode step's seconds a token -> the split to run from the next step, where it changes."""
        if not self._phase:
            return None
        self._seen.append(seconds_per_token)
        if len(self._seen) < self.settle + self.steps_per_round:
            return None
        previous = self._current
        self._timed[previous] += self._seen[self.settle:]
        self._turn, self._seen = self._turn + 1, []
        if self._turn == self.rounds * len(self._phase):
            self._end_phase()
        following = self._current if self._phase else self.best
        return following if following != previous else None

    def _end_phase(self) -> None:
        for split, timed in self._timed.items():
            self.times[split] = sorted(timed)[len(timed) // 2]
        fastest = min(self._phase, key=self.times.__getitem__)  # NOTE: a tie keeps the phase's first (the prior)
        reference = self.reference
        if reference in self._timed and self.times[fastest] > self.times[reference] * (1 - self.margin):
            fastest = reference  # not clearly faster than the reference
        moved = fastest != self.best or math.isinf(self.best_seconds)  # the first phase always moves on
        self.best, self.best_seconds = fastest, self.times[fastest]
        untimed = [c for c in self._neighbours(fastest) if c not in self.times] if moved else []
        again = [reference] if reference is not None and reference not in (fastest, *untimed) else []
        self._start([fastest, *untimed, *again] if untimed else [])

    def _neighbours(self, split: tuple[float, float]) -> list[tuple[float, float]]:
        share, lead = split
        shares = (round(min(1.0, max(0.0, share + d)), 2) for d in (-self.delta, self.delta))
        return [(s, lead if 0.0 < s < 1.0 else 0.0) for s in shares if s != share]


FIRST_RESEARCH = 256  # the first search ran while a cache was filling: a second one once it is warmer
RESEARCH_DRIFT = 0.05  # a new search where the running split's steps moved this much from its searched time
RECENT_STEPS = 16  # the running split's last steps, whose median is its time now


class Split:
    """The split of hybrid mode (module doc): `share` and `lead`, from the link and the CPU measured at start, alone
    and at once (on CUDA with a ringing device; the CPU task's fixed cost too), the CPU's rate then re-measured from
    the tasks' own counters every `every` decode steps. Stream mode streams every miss (share 1), cpu mode none
    (share 0); hybrid streams every miss where the host's memory feeds no more to both than to the link alone.
    `link`: how busy streamed misses keep the link, for `uploads_cpu_misses`."""

    def __init__(self, mode: MissMode, device: torch.device, banks: Sequence[ExpertWeights], on_device: bool,
                 every: int = 64, link_cap_gbps: float | None = None, cpu: CpuTasks | None = None,
                 cached_share: float = 0.0, research: int = 4096) -> None:
        self.every, self.research, self.link_gbps, self.cpu_gbps, self.fixed_seconds = every, research, 0.0, 0.0, 0.0
        self.later_misses = later_misses_of(cached_share)
        # NOTE: with a cache, hybrid leaves streaming every miss only for a split clearly faster (`SplitSearch`): at 25%
        # and 50% the searches' choices ran 3-5% behind stream (H100, 2026-12-06, fourth lease)
        self.reference = (1.0, 0.0) if cached_share > 0 else None
        self.at_once_gbps: tuple[float, float] | None = None  # (link, CPU) reading host memory together
        self.max_missed = 8
        bank = banks[0] if banks else None
        self.expert_bytes = bank.expert_bytes if bank is not None else 0
        self.hybrid = mode.uses_cpu and mode.streams and bank is not None
        self.share, self.lead = (1.0 if not mode.uses_cpu else 0.0), 0.0
        self._steps, self._cpu_alone = 0, 0.0
        self._recent: deque[float] = deque(maxlen=RECENT_STEPS)  # the running split's last steps' seconds a token
        self._last: CpuWork | None = None
        self._cpu_bytes: int | None = None  # the CPU's bytes at the last step, for `_later_seconds`
        self.model = (self.share, self.lead)  # the model's split (module doc), the searches' prior
        self.search: SplitSearch | None = None
        self._search_at = min(FIRST_RESEARCH, research)  # the next search's step (once the one before is done)
        if self.hybrid:
            assert bank is not None
            self._measure(banks, device, on_device, link_cap_gbps, cpu)
            self.model = self.share, self.lead = self._split()
            self.search = SplitSearch(self.model, reference=self.reference)
        self.link = LinkLoad(self.link_gbps)

    def _measure(self, banks: Sequence[ExpertWeights], device: torch.device, on_device: bool,
                 link_cap_gbps: float | None, cpu: CpuTasks | None) -> None:
        bank, other = banks[0], banks[-1]
        threads = cpu.num_threads if cpu is not None else None
        self.link_gbps = measure_stream_gbps(bank, device) if on_device else measure_link_gbps(device)
        self.cpu_gbps = measure_cpu_gbps(other, num_threads=threads)
        if on_device and cpu is not None and cpu.rings:
            self.max_missed = cpu.job.expert_ids.shape[0] // cpu.job.x.shape[0]
            self.fixed_seconds, _ = cpu_task_costs(cpu, next(iter(cpu.tasks)), self.max_missed)
            self.at_once_gbps = measure_shared_gbps(bank, other, device, cpu.num_threads)
        if link_cap_gbps:  # a slower link simulated: it alone limits the device's share
            scale = min(1.0, link_cap_gbps / self.link_gbps)
            self.link_gbps *= scale
            if self.at_once_gbps is not None:
                self.at_once_gbps = (self.at_once_gbps[0] * scale, self.at_once_gbps[1])
        self._cpu_alone = self.cpu_gbps

    @property
    def uploads_cpu_misses(self) -> bool:
        """Hybrid: promote the experts the CPU computed by uploads (they never crossed the link), while the
        streamed misses leave the link mostly idle. A CPU-computed expert does not land, so its next use misses
        again: at a 50% budget each costs about one later miss, at 25% 0.2 (replaying bench's requests:
        tests/engine/expert_cache/test_cache_replay.py), where the uploads would share a link the step waits on
        (docs/benchmarks.md)."""
        return self.is_hybrid and self.link.busy < UPLOAD_LINK_BUSY

    def _split(self) -> tuple[float, float]:
        at_once = None
        if self.at_once_gbps is not None:  # the CPU's part scaled by how its own rate moved since the start
            at_once = (self.at_once_gbps[0] * 1e9,
                       self.at_once_gbps[1] * 1e9 * self.cpu_gbps / (self._cpu_alone or self.cpu_gbps))
        return best_split(self.expert_bytes, self.link_gbps * 1e9, self.cpu_gbps * 1e9, self.fixed_seconds, at_once,
                          self.max_missed, self.later_misses)

    def describe(self) -> str:
        """The split and what it was measured from (hybrid mode), for the cache's description."""
        if not self.hybrid:
            return ""
        at_once = f", at once {self.at_once_gbps[0]:.1f} + {self.at_once_gbps[1]:.1f}" if self.at_once_gbps else ""
        timed = ""
        if self.search is not None and self.search.times:
            timed = "; timed " + ", ".join(f"{s:.2f}/{lead:.2f} {t * 1e3:.2f} ms" for (s, lead), t in
                                           self.search.times.items())
        return (f" (streams round({self.share:.2f} x misses + {self.lead:.2f}) of a layer's misses; model "
                f"{self.model[0]:.2f}/{self.model[1]:.2f} from link {self.link_gbps:.1f}, CPU {self.cpu_gbps:.1f}"
                f"{at_once} GB/s, CPU task {self.fixed_seconds * 1e6:.0f} us, {self.later_misses:.2f} later misses a "
                f"CPU expert{timed})")

    @property
    def is_hybrid(self) -> bool:
        """Both the link and the CPU take misses (hybrid mode may stream them all)."""
        return 0.0 < self.share < 1.0

    def update(self, work: CpuWork, seconds_per_token: float, num_tokens: int = 1) -> tuple[float, float] | None:
        """After a decode step of `num_tokens` tokens (the CPU counters as they stand, its seconds a token): the new
        (share, lead) where it changes. The search sees the step charged its later misses (`_later_seconds`)."""
        if not self.hybrid:
            return None
        self._steps += 1
        later = self._later_seconds(work) / max(num_tokens, 1)
        self._remodel(work)
        if self.search is not None and self.search.is_done and self._steps >= self._search_at:
            self._search_at = self._steps + self.research
            if self._has_drifted(self.search.best_seconds):
                # NOTE: from the split running now, the model's as it stands among the others; local: a search of
                # step 256 that timed both ends again ran every miss on the CPU for 12 steps of a warm cache's run
                self.search = SplitSearch((self.share, self.lead), [self.model], local=True,
                                          reference=self.reference)
                self._recent.clear()
        assert self.search is not None
        if self.search.is_done:  # the running split's step
            self._recent.append(seconds_per_token + later)
        following = self.search.observe(seconds_per_token + later)
        if following is None or following == (self.share, self.lead):
            return None
        self.share, self.lead = following
        return following

    def _has_drifted(self, searched: float) -> bool:
        """Whether the running split's last steps take another time than its search gave it (or it has none)."""
        if math.isinf(searched) or len(self._recent) < RECENT_STEPS:
            return True
        now = sorted(self._recent)[len(self._recent) // 2]
        return abs(now / searched - 1.0) > RESEARCH_DRIFT

    def _later_seconds(self, work: CpuWork) -> float:
        """The link's seconds for the later misses of the experts the CPU computed since the last step (its bytes
        from the counters); none without a cache."""
        before, self._cpu_bytes = self._cpu_bytes, work.bytes
        if before is None or self.later_misses <= 0 or self.link_gbps <= 0:
            return 0.0
        return self.later_misses * max(work.bytes - before, 0) / (self.link_gbps * 1e9)

    def _remodel(self, work: CpuWork) -> None:
        """Every `every` steps: the CPU's rate from its counters, and the model's split from it."""
        if self._last is None or self._steps % self.every:
            self._last = self._last or work
            return
        busy, moved = work.busy_seconds - self._last.busy_seconds, work.bytes - self._last.bytes
        self._last = work
        if busy > 0 and moved > 0:
            self.cpu_gbps = moved / busy / 1e9
            self.model = self._split()
