"""A sweep's results: per configuration, the medians of its runs, the bound beside them, and every phase."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.expert_cache.placement import MiB
from engine.llm_engine import LLMEngine
from service.bench.bound import Bound, TokenBytes, decode_bound, token_bytes
from service.bench.ceilings import Ceilings
from service.bench.runner import (
    CacheDelta,
    DecodeFigures,
    Phase,
    PrefillFigures,
    RunSettings,
    apply,
    decode_figures,
    measure,
    prefill_figures,
)
from service.bench.sweep import SweepPoint


@dataclass(frozen=True)
class ConfigResult:
    point: SweepPoint
    applied_budget_mib: float  # a fraction resolved against the host expert bytes, or the automatic budget
    cache_bytes: int
    num_slots: int
    cached_share: float  # share of the host-RAM experts that have a slot
    num_host_layers: int
    placement_reason: str
    describe: str
    token_bytes: TokenBytes
    prefill: PrefillFigures
    decode: tuple[DecodeFigures, ...]  # one per batch size
    bound: Bound | None  # batch-1 decode, at its hit ratio; None when batch 1 was not measured
    phases: tuple[Phase, ...]
    totals: CacheDelta  # the configuration's cache over all its phases

    def decode_at(self, batch: int) -> DecodeFigures:
        return next(d for d in self.decode if d.batch == batch)


@dataclass(frozen=True)
class Skipped:
    point: SweepPoint
    reason: str


def _bound(decode: Sequence[DecodeFigures], token: TokenBytes, ceilings: Ceilings) -> Bound | None:
    single = [d for d in decode if d.batch == 1]
    return decode_bound(token, single[0].hit_ratio, ceilings) if single else None


def run_configuration(engine: LLMEngine, point: SweepPoint, settings: RunSettings, routing: str,
                      ceilings: Ceilings) -> ConfigResult | Skipped:
    reason = apply(engine, point)
    if reason is not None:
        return Skipped(point, reason)
    phases = measure(engine, settings, routing)
    cache, moe = engine.cache, engine.weights.moe_layers
    per_expert = {i: engine.store.expert_bytes(i) for i in moe}
    token = token_bytes(engine.weights, per_expert, cache.placement.host_layers)
    decode = tuple(decode_figures(phases, b) for b in settings.batches)
    placement, plan = cache.placement, cache.plan
    return ConfigResult(point, placement.budget_bytes / MiB, plan.cache_bytes, plan.num_slots, plan.share,
                        len(placement.host_layers), placement.reason, cache.describe(), token,
                        prefill_figures(phases), decode, _bound(decode, token, ceilings), tuple(phases),
                        CacheDelta.of(cache.snapshot()))


def run_sweep(engine: LLMEngine, points: Sequence[SweepPoint], settings: RunSettings, routing: str,
              ceilings: Ceilings, progress: Callable[[str], None] | None = None,
              on_result: Callable[[list[ConfigResult | Skipped]], None] | None = None) -> list[ConfigResult | Skipped]:
    """Every point in turn; `on_result` sees the results so far after each (a long sweep cut short keeps
    what it measured)."""
    results: list[ConfigResult | Skipped] = []
    for n, point in enumerate(points, 1):
        results.append(run_configuration(engine, point, settings, routing, ceilings))
        if progress is not None:
            progress(f"[{n}/{len(points)}] {summary(results[-1])}")
        if on_result is not None:
            on_result(results)
    return results


def summary(result: ConfigResult | Skipped) -> str:
    p = result.point
    head = f"budget {p.budget_label}, {p.policy}, misses on {p.miss_mode}, n-cpu-moe {p.n_cpu_moe}"
    if isinstance(result, Skipped):
        return f"{head}: skipped ({result.reason})"
    rates = ", ".join(f"batch {d.batch} {d.tokens_per_second:.1f} tok/s" for d in result.decode)
    return f"{head}: {rates}, hit {result.decode[0].hit_ratio:.1%}"
