"""Measuring one cache configuration on a loaded engine, and the sweep over configurations.

A run is a prefill (one request of `prompt_len` tokens; its time is the time to first token) and, for
each batch size B, B requests decoding together: first their short prompts, then `gen_len - 1` decode
steps. Every phase records its tokens, seconds and what the cache counted, so the figures of a
configuration add up to its cache's totals. Run 0 is the warm-up; the figures are medians of the rest.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.config import CacheConfig
from engine.expert_cache.placement import choose_placement
from engine.expert_cache.plan import CacheBudgetError
from engine.expert_cache.stats import CacheStatsSnapshot
from engine.llm_engine import LLMEngine
from engine.types import Request, SamplingParams
from service.bench.sweep import SweepPoint, cache_config
from tools.routing import make_router

PREFILL, DECODE_PROMPT, DECODE = "prefill", "decode-prompt", "decode"


@dataclass(frozen=True)
class RunSettings:
    prompt_len: int  # tokens of the prefill request
    decode_prompt_len: int  # prompt of each decoding request
    gen_len: int  # tokens each decoding request generates (ignore_eos)
    batches: tuple[int, ...]  # requests decoding together
    repeats: int  # measured runs after the warm-up
    seed: int = 0  # prompt token ids
    warmup_gen_len: int = 0  # tokens each decoding request of the warm-up run generates (0: gen_len)

    def __post_init__(self) -> None:
        if min(self.prompt_len, self.decode_prompt_len, self.repeats, *self.batches) < 1 or self.gen_len < 2:
            raise ValueError("prompt lengths, batches and repeats must be >= 1 and gen_len >= 2")
        if self.warmup_gen_len == 1 or self.warmup_gen_len < 0:
            raise ValueError("warmup_gen_len must be 0 (gen_len) or >= 2")

    def gen_len_of(self, run: int) -> int:
        """Tokens each decoding request of run `run` generates (run 0 is the warm-up)."""
        return self.warmup_gen_len if run == 0 and self.warmup_gen_len else self.gen_len

    @property
    def context_len(self) -> int:
        return max(self.prompt_len + 1, self.decode_prompt_len + max(self.gen_len, self.warmup_gen_len))


@dataclass(frozen=True)
class CacheDelta:
    """What the expert cache counted over a span of steps."""

    hits: float
    misses: float
    uploaded_bytes: float
    streamed_bytes: float
    cpu_experts: float
    promotions: float = 0  # experts taken into the cache: landed misses and uploads
    cpu_seconds: float = 0.0  # the CPU's time on missed experts
    disk_read_bytes: float = 0  # experts read from the GGUF file into the host-RAM tier (--ssd-moe)
    ram_hits: float = 0  # experts a disk layer found in the host-RAM tier
    ram_misses: float = 0  # and those it read from the file

    @classmethod
    def of(cls, s: CacheStatsSnapshot) -> CacheDelta:
        return cls(s.hits(), s.misses(), s.uploaded_bytes, s.streamed_bytes, s.cpu_experts, s.promotions,
                   s.cpu_seconds, s.disk_read_bytes, s.ram_hits, s.ram_misses)

    def minus(self, earlier: CacheDelta) -> CacheDelta:
        return CacheDelta(*(a - b for a, b in zip(_values(self), _values(earlier))))

    @property
    def hit_ratio(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0


def _values(d: CacheDelta) -> tuple[float, ...]:
    return (d.hits, d.misses, d.uploaded_bytes, d.streamed_bytes, d.cpu_experts, d.promotions, d.cpu_seconds,
            d.disk_read_bytes, d.ram_hits, d.ram_misses)


@dataclass(frozen=True)
class Phase:
    kind: str  # PREFILL | DECODE_PROMPT | DECODE
    batch: int  # requests in the phase
    run: int  # 0: the warm-up
    tokens: int  # prompt tokens computed (prefill, decode-prompt) or tokens generated (decode)
    seconds: float
    cache: CacheDelta

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    def per_token(self, count: float) -> float:
        return count / self.tokens


@dataclass(frozen=True)
class DecodeFigures:
    batch: int
    tokens_per_second: float
    hit_ratio: float  # decode steps only
    uploaded_bytes_per_token: float
    streamed_bytes_per_token: float
    cpu_experts_per_token: float
    cpu_seconds_per_token: float = 0.0  # the CPU's time on missed experts (its tasks)
    disk_bytes_per_token: float = 0.0  # expert bytes read from the GGUF file (--ssd-moe)


@dataclass(frozen=True)
class PrefillFigures:
    tokens_per_second: float
    ttft_seconds: float


class Prompts:
    """Random prompt ids from one seed: every configuration of a sweep sees the same prompts."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size, self.rng = vocab_size, np.random.default_rng(seed)
        self.count = 0

    def next(self, length: int) -> tuple[str, tuple[int, ...]]:
        self.count += 1
        return f"bench-{self.count}", tuple(int(t) for t in self.rng.integers(0, self.vocab_size, length))


class GivenPrompts:
    """Given prompts' ids in turn, whatever length is asked: bench-serve's streams' own prompts, for the engine beside
    them (a batch of up to as many requests as prompts gets distinct ones)."""

    def __init__(self, prompts: Sequence[tuple[int, ...]]) -> None:
        self.prompts, self.count = tuple(prompts), 0

    def next(self, length: int) -> tuple[str, tuple[int, ...]]:
        ids = self.prompts[self.count % len(self.prompts)]
        self.count += 1
        return f"bench-{self.count}", ids


def _snapshot(engine: LLMEngine) -> CacheDelta:
    # NOTE: the last step's record is processed while the next step runs: count it in its own phase
    engine.cache.flush()
    return CacheDelta.of(engine.cache.snapshot())


def _add(engine: LLMEngine, prompts: Prompts | GivenPrompts, length: int, max_tokens: int) -> None:
    request_id, ids = prompts.next(length)
    engine.add_request(Request(request_id, ids, SamplingParams(max_tokens, temperature=0.0, ignore_eos=True)))


def _steps_until(engine: LLMEngine, is_done: Callable[[set[str]], bool]) -> int:
    """Steps until `is_done(ids of the requests that have a token)`; returns the tokens generated."""
    started: set[str] = set()
    generated = 0
    while not is_done(started):
        outputs = engine.step()
        started.update(o.request_id for o in outputs if o.new_token_ids)
        generated += sum(len(o.new_token_ids) for o in outputs)
    return generated


def prefill_phase(engine: LLMEngine, prompts: Prompts, settings: RunSettings, run: int) -> Phase:
    """One request of `prompt_len` tokens, timed to its first token."""
    before, start = _snapshot(engine), time.perf_counter()
    _add(engine, prompts, settings.prompt_len, 1)
    _steps_until(engine, lambda started: not engine.has_unfinished())
    seconds = time.perf_counter() - start
    return Phase(PREFILL, 1, run, settings.prompt_len, seconds, _snapshot(engine).minus(before))


def decode_phases(engine: LLMEngine, prompts: Prompts | GivenPrompts, settings: RunSettings, batch: int,
                  run: int) -> list[Phase]:
    """`batch` requests: their prompts until each has its first token, then the decode steps."""
    before, start = _snapshot(engine), time.perf_counter()
    for _ in range(batch):
        _add(engine, prompts, settings.decode_prompt_len, settings.gen_len_of(run))
    # NOTE: tokens sampled while other prompts are still prefilling belong to the prompt phase.
    _steps_until(engine, lambda started: len(started) == batch)
    middle, decode_start = _snapshot(engine), time.perf_counter()
    generated = _steps_until(engine, lambda started: not engine.has_unfinished())
    end, decode_end = _snapshot(engine), time.perf_counter()
    first = Phase(DECODE_PROMPT, batch, run, batch * settings.decode_prompt_len, decode_start - start,
                  middle.minus(before))
    return [first, Phase(DECODE, batch, run, generated, decode_end - decode_start, end.minus(middle))]


def measure(engine: LLMEngine, settings: RunSettings, routing: str) -> list[Phase]:
    """The warm-up run and `repeats` measured runs on the engine's current cache."""
    # a fresh router per configuration: each sees the same routing streams
    engine.set_router(make_router(routing, engine.weights, engine.scheduler.config.max_num_batched_tokens,
                                  engine.device))
    prompts, phases = Prompts(engine.weights.hparams.vocab_size, settings.seed), []
    for run in range(settings.repeats + 1):
        phases.append(prefill_phase(engine, prompts, settings, run))
        for batch in settings.batches:
            phases += decode_phases(engine, prompts, settings, batch, run)
    return phases


def _median(phases: Sequence[Phase], value: Callable[[Phase], float]) -> float:
    return statistics.median(value(p) for p in phases)


def prefill_figures(phases: Sequence[Phase]) -> PrefillFigures:
    measured = [p for p in phases if p.kind == PREFILL and p.run > 0]
    return PrefillFigures(_median(measured, lambda p: p.tokens_per_second),
                          _median(measured, lambda p: p.seconds))


def decode_figures(phases: Sequence[Phase], batch: int) -> DecodeFigures:
    m = [p for p in phases if p.kind == DECODE and p.batch == batch and p.run > 0]
    return DecodeFigures(batch, _median(m, lambda p: p.tokens_per_second),
                         _median(m, lambda p: p.cache.hit_ratio),
                         _median(m, lambda p: p.per_token(p.cache.uploaded_bytes)),
                         _median(m, lambda p: p.per_token(p.cache.streamed_bytes)),
                         _median(m, lambda p: p.per_token(p.cache.cpu_experts)),
                         _median(m, lambda p: p.per_token(p.cache.cpu_seconds)),
                         _median(m, lambda p: p.per_token(p.cache.disk_read_bytes)))


def host_layers(engine: LLMEngine, cfg: CacheConfig) -> tuple[int, ...]:
    """The MoE layers whose routed experts `cfg` places in host RAM."""
    free = torch.cuda.mem_get_info(engine.device)[0] if engine.device.type == "cuda" else None
    return choose_placement(engine.store.layer_bytes(), cfg, free, engine.kv.num_bytes).host_layers


def apply(engine: LLMEngine, point: SweepPoint) -> str | None:
    """Reconfigure the engine's cache for `point`; the reason when the budget caches nothing."""
    base = engine.config.cache
    layers = host_layers(engine, cache_config(point, base, 0))
    cfg = cache_config(point, base, sum(engine.store.layer_bytes()[i] for i in layers))
    try:
        engine.reconfigure_cache(cfg)
    except CacheBudgetError as exc:
        engine.reconfigure_cache(replace(cfg, budget_mib=0))  # a valid cache for the next configuration
        return str(exc)
    return None
