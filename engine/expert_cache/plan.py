"""Expert-cache sizing: group the host-RAM MoE layers by tensor types and split a byte budget into slots.

Layers whose routed experts have the same types and shapes form one group with one pool of slots (a
slot holds one expert: gate + up + down). The budget is split across groups in proportion to their
host expert bytes (water-filling: a group never gets more slots than it has experts, the rest goes to
the others). A group with fewer slots than `top_k` is not cached: its budget goes to the other groups
and the plan carries a warning.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

MiB = 1 << 20


class CacheBudgetError(ValueError):
    """A positive cache budget too small to cache any group; names the smallest useful budget."""

    def __init__(self, budget_bytes: int, smallest_mib: int) -> None:
        self.budget_bytes = budget_bytes
        self.smallest_mib = smallest_mib
        super().__init__(
            f"an expert cache of {budget_bytes / MiB:.1f} MiB caches nothing (every layer group needs at "
            f"least top_k slots); the smallest useful budget is {smallest_mib} MiB"
        )


@dataclass(frozen=True)
class LayerExperts:
    """The routed experts of one MoE layer that live in host RAM."""

    layer: int  # model layer index
    num_experts: int
    top_k: int
    expert_bytes: int  # raw GGUF bytes of one expert: gate + up + down
    type_key: Hashable  # (qtype, shape) of gate/up/down; equal keys -> same group

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"layer {self.layer}: top_k {self.top_k} not in [1, {self.num_experts}]")
        if self.expert_bytes < 1:
            raise ValueError(f"layer {self.layer}: expert_bytes must be positive, got {self.expert_bytes}")

    @property
    def group_key(self) -> tuple[Hashable, int, int, int]:
        return (self.type_key, self.num_experts, self.top_k, self.expert_bytes)


@dataclass(frozen=True)
class GroupPlan:
    """One pool of `num_slots` slots shared by `layers` (same expert types and shapes)."""

    group_id: int
    layers: tuple[int, ...]
    num_experts: int  # per layer
    top_k: int
    slot_bytes: int
    num_slots: int

    def __post_init__(self) -> None:
        if not self.layers or len(set(self.layers)) != len(self.layers):
            raise ValueError(f"group {self.group_id}: layers {self.layers} must be distinct and non-empty")
        if not 0 <= self.num_slots <= self.num_host_experts:
            raise ValueError(
                f"group {self.group_id}: {self.num_slots} slots for {self.num_host_experts} experts"
            )

    @property
    def num_host_experts(self) -> int:
        return len(self.layers) * self.num_experts

    @property
    def cache_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def host_bytes(self) -> int:
        return self.num_host_experts * self.slot_bytes

    @property
    def share(self) -> float:
        """Cached fraction of the group's experts."""
        return self.num_slots / self.num_host_experts

    @property
    def is_cached(self) -> bool:
        return self.num_slots > 0


@dataclass(frozen=True)
class CachePlan:
    groups: tuple[GroupPlan, ...]
    budget_bytes: int
    warnings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # NOTE: the cache never exceeds its byte budget.
        if self.cache_bytes > self.budget_bytes:
            raise ValueError(f"plan needs {self.cache_bytes} bytes, budget is {self.budget_bytes}")
        layers = [layer for g in self.groups for layer in g.layers]
        if len(set(layers)) != len(layers):
            raise ValueError("a layer belongs to at most one group")

    @property
    def cache_bytes(self) -> int:
        return sum(g.cache_bytes for g in self.groups)

    @property
    def num_slots(self) -> int:
        return sum(g.num_slots for g in self.groups)

    @property
    def share(self) -> float:
        """Cached fraction of all host-RAM experts (0 when there are none)."""
        total = sum(g.num_host_experts for g in self.groups)
        return self.num_slots / total if total else 0.0

    def group_of(self, layer: int) -> GroupPlan | None:
        return next((g for g in self.groups if layer in g.layers), None)


def group_layers(layers: Sequence[LayerExperts]) -> list[tuple[LayerExperts, ...]]:
    """Layers with equal types and shapes, in order of their first layer."""
    indices = [x.layer for x in layers]
    if len(set(indices)) != len(indices):
        raise ValueError(f"duplicate layer indices in {sorted(indices)}")
    groups: dict[tuple[Hashable, int, int, int], list[LayerExperts]] = {}
    for x in sorted(layers, key=lambda x: x.layer):
        groups.setdefault(x.group_key, []).append(x)
    return [tuple(g) for g in groups.values()]


def _host_bytes(group: tuple[LayerExperts, ...]) -> int:
    return len(group) * group[0].num_experts * group[0].expert_bytes


def _split(budget_bytes: int, groups: Sequence[tuple[LayerExperts, ...]]) -> list[int]:
    """Slots per group: budget in proportion to host bytes, capped at a group's expert count."""
    slots = [0] * len(groups)
    open_ = list(range(len(groups)))
    remaining = budget_bytes
    while open_:
        weight = sum(_host_bytes(groups[i]) for i in open_)
        full = [i for i in open_ if remaining * _host_bytes(groups[i]) // weight >= _host_bytes(groups[i])]
        if not full:
            for i in open_:
                slots[i] = remaining * _host_bytes(groups[i]) // weight // groups[i][0].expert_bytes
            return slots
        for i in full:
            slots[i] = _host_bytes(groups[i]) // groups[i][0].expert_bytes
            remaining -= _host_bytes(groups[i])
            open_.remove(i)
    return slots


def _cached_slots(budget_bytes: int, groups: Sequence[tuple[LayerExperts, ...]]) -> list[int]:
    """Drops the groups short of top_k slots one at a time (worst first) and re-splits the budget."""
    kept = list(range(len(groups)))
    while kept:
        slots = dict(zip(kept, _split(budget_bytes, [groups[i] for i in kept]), strict=True))
        short = [i for i in kept if slots[i] < groups[i][0].top_k]
        if not short:
            return [slots.get(i, 0) for i in range(len(groups))]
        kept.remove(min(short, key=lambda i: slots[i] / groups[i][0].top_k))
    return [0] * len(groups)


def _group_plan(group_id: int, group: tuple[LayerExperts, ...], num_slots: int) -> GroupPlan:
    first = group[0]
    layers = tuple(x.layer for x in group)
    return GroupPlan(group_id, layers, first.num_experts, first.top_k, first.expert_bytes, num_slots)


def _warning(plan: GroupPlan, want_slots: int, smallest_mib: int) -> str:
    layers = f"{len(plan.layers)} layers, {plan.layers[0]}..{plan.layers[-1]}"
    return (
        f"expert cache: group {plan.group_id} ({layers}) gets {want_slots} slots < top_k {plan.top_k} "
        f"and is not cached; {smallest_mib} MiB caches every group"
    )


def plan_cache(layers: Sequence[LayerExperts], budget_bytes: int, first_group: int = 0) -> CachePlan:
    """Slots per group for `budget_bytes`; 0 means no cache. Raises CacheBudgetError if nothing fits.
    first_group: the id of the first group (the groups of several devices' plans are numbered on)."""
    if budget_bytes < 0:
        raise ValueError(f"cache budget must be >= 0, got {budget_bytes}")
    groups = group_layers(layers)
    slots = _cached_slots(budget_bytes, groups)
    plans = tuple(_group_plan(first_group + i, g, n) for i, (g, n) in enumerate(zip(groups, slots, strict=True)))
    if budget_bytes == 0 or not groups:
        return CachePlan(plans, budget_bytes)
    if not any(slots):
        raise CacheBudgetError(budget_bytes, smallest_useful_budget(layers) // MiB)
    dropped = [(p, n) for p, n in zip(plans, _split(budget_bytes, groups), strict=True) if not p.is_cached]
    smallest_mib = smallest_useful_budget(layers) // MiB if dropped else 0
    return CachePlan(plans, budget_bytes, tuple(_warning(p, n, smallest_mib) for p, n in dropped))


def smallest_useful_budget(layers: Sequence[LayerExperts]) -> int:
    """Bytes (whole MiB): the smallest budget at which `plan_cache` gives every group top_k slots."""
    groups = group_layers(layers)
    if not groups:
        return 0

    def caches_all(mib: int) -> bool:
        return all(n >= g[0].top_k for n, g in zip(_split(mib * MiB, groups), groups, strict=True))

    # NOTE: each group's share of the split grows with the budget, so `caches_all` is monotone.
    lo, hi = 0, -(-sum(_host_bytes(g) for g in groups) // MiB)  # caches_all(hi) holds
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if caches_all(mid) else (mid, hi)
    return hi * MiB


def plan_devices(parts: Sequence[Sequence[LayerExperts]], budgets: Sequence[int],
                 labels: Sequence[str]) -> tuple[CachePlan, ...]:
    """One plan a device (several devices: a split model), each over its own layers and budget, their groups
    numbered on from one device to the next. A device whose budget caches nothing gets no cache (a warning) while
    another's caches something; where none does, CacheBudgetError names the smallest total budget that, split in
    proportion to the devices' host expert bytes, gives every device a cache."""
    if len(parts) == 1:
        return (plan_cache(parts[0], budgets[0]),)
    plans: list[CachePlan] = []
    for layers, budget, label in zip(parts, budgets, labels, strict=True):
        first = sum(len(p.groups) for p in plans)
        try:
            plans.append(plan_cache(layers, budget, first))
        except CacheBudgetError as exc:
            empty = plan_cache(layers, 0, first)
            plans.append(CachePlan(empty.groups, budget, (f"expert cache on {label}: {exc}",)))
    if sum(budgets) and not any(p.num_slots for p in plans):
        raise CacheBudgetError(sum(budgets), smallest_split_budget(parts) // MiB)
    return tuple(plans)


def smallest_split_budget(parts: Sequence[Sequence[LayerExperts]]) -> int:
    """Bytes (whole MiB): the smallest total budget that, split in proportion to each device's host expert bytes,
    gives each device with host experts its smallest useful budget."""
    host = [sum(_host_bytes(g) for g in group_layers(layers)) for layers in parts]
    total = sum(host)
    need = [-(-smallest_useful_budget(layers) * total // h) for layers, h in zip(parts, host, strict=True) if h]
    return -(-max(need, default=0) // MiB) * MiB


def merge_plans(plans: Sequence[CachePlan]) -> CachePlan:
    """The devices' plans as one (the cache as a whole: its groups, budget and warnings)."""
    if len(plans) == 1:
        return plans[0]
    return CachePlan(tuple(g for p in plans for g in p.groups), sum(p.budget_bytes for p in plans),
                     tuple(w for p in plans for w in p.warnings))
