"""The configurations of a sweep: the cartesian product of budgets, policies, miss modes and placements,
each turned into the `CacheConfig` that `LLMEngine.reconfigure_cache` applies."""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from engine.config import CacheConfig

MiB = 1 << 20
T = TypeVar("T")


def comma_list(item: Callable[[str], T], choices: Sequence[str] = ()) -> Callable[[str], list[T]]:
    """An argparse `type`: "a,b,c" -> [item("a"), item("b"), item("c")], each in `choices` if given."""

    def parse(text: str) -> list[T]:
        values = [item(part.strip()) for part in text.split(",") if part.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        wrong = [v for v in values if choices and v not in choices]
        if wrong:
            raise argparse.ArgumentTypeError(f"{wrong[0]!r} is not one of {', '.join(choices)}")
        return values

    parse.__name__ = f"list of {getattr(item, '__name__', 'values')}"  # argparse names the type in errors
    return parse


def fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a budget fraction is in [0, 1], got {value}")
    return value


@dataclass(frozen=True)
class SweepPoint:
    """One cache configuration: a budget (MiB, a share of the host-RAM expert bytes, or automatic)."""

    policy: str
    miss_mode: str
    n_cpu_moe: int
    budget_mib: int | None = None  # None with budget_frac None: the automatic budget
    budget_frac: float | None = None

    @property
    def budget_label(self) -> str:
        if self.budget_frac is not None:
            return f"{self.budget_frac:.0%}"
        return "auto" if self.budget_mib is None else f"{self.budget_mib} MiB"


def sweep_points(policies: Sequence[str], miss_modes: Sequence[str], n_cpu_moe: Sequence[int],
                 budgets_mib: Sequence[int | None] = (None,),
                 budget_fracs: Sequence[float] = ()) -> list[SweepPoint]:
    """Every combination; budgets vary fastest after the placement, then policy, then miss mode."""
    budgets: list[tuple[int | None, float | None]] = [(None, f) for f in budget_fracs]
    budgets = budgets or [(m, None) for m in budgets_mib]
    return [SweepPoint(policy, mode, n, mib, frac)
            for n, (mib, frac), policy, mode in itertools.product(n_cpu_moe, budgets, policies, miss_modes)]


def budget_mib(point: SweepPoint, host_expert_bytes: int) -> int | None:
    """MiB for the point; a fraction rounds up, so 1.0 caches every host expert."""
    if point.budget_frac is None:
        return point.budget_mib
    return math.ceil(point.budget_frac * host_expert_bytes / MiB)


def cache_config(point: SweepPoint, base: CacheConfig, host_expert_bytes: int) -> CacheConfig:
    return replace(base, policy=point.policy, miss_mode=point.miss_mode, n_cpu_moe=point.n_cpu_moe,
                   budget_mib=budget_mib(point, host_expert_bytes))
