"""Expert-cache policies: which experts hold the slots of one cached group (torch-free).

After each decode step the engine calls `observe` with the experts each of the group's layers
selected and starts the copies it returns; the policy's state (`slot_of`, `residents`) already counts
those copies, so a copy in flight is never chosen twice. An expert is `(layer, expert)`.

- `lru`: one pool shared by the group's layers; every miss is inserted over the least recently used.
- `decay`: per-layer slots; a score decays per token, +1 per use; a missed expert that outscores the
  weakest resident replaces it, at most `promote_per_step` copies per step.
- `lfru`: per-layer slots; use counts halved periodically; replace only when clearly hotter.
- `static`: the most used experts of a profile, fixed.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from engine.expert_cache.plan import GroupPlan
from engine.expert_cache.profile import Profile

Expert = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class Promotion:
    """Copy (layer, expert) into `slot`; `evicted` held the slot until now."""

    slot: int
    layer: int
    expert: int
    evicted: Expert | None


@dataclass(frozen=True)
class PolicyConfig:
    promote_per_step: int = 8
    decay: float = 0.9
    lfru_halve_every: int = 128
    lfru_margin: float = 2.0

    def __post_init__(self) -> None:
        if self.promote_per_step < 1 or self.lfru_halve_every < 1:
            raise ValueError("promote_per_step and lfru_halve_every must be >= 1")
        if not 0.0 < self.decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {self.decay}")
        if self.lfru_margin < 1.0:
            raise ValueError(f"lfru_margin must be >= 1, got {self.lfru_margin}")


def layer_slots(group: GroupPlan) -> dict[int, range]:
    """Per-layer split of the group's slots: even, one extra for each of the first `remainder` layers."""
    base, extra = divmod(group.num_slots, len(group.layers))
    bounds = np.cumsum([0] + [base + (i < extra) for i in range(len(group.layers))])
    return {layer: range(bounds[i], bounds[i + 1]) for i, layer in enumerate(group.layers)}


class CachePolicy(ABC):
    """One instance per cached group; slots are numbered 0..group.num_slots-1."""

    name: ClassVar[str]
    needs_profile: ClassVar[bool] = False

    def __init__(self, group: GroupPlan, config: PolicyConfig) -> None:
        self.group = group
        self.config = config
        self._layers = frozenset(group.layers)
        self._held: list[Expert | None] = [None] * group.num_slots  # slot -> expert
        self._slot: dict[Expert, int] = {}  # expert -> slot
        self._cursor: dict[int, int] = {}  # region start -> first slot that may be empty

    def slot_of(self, layer: int, expert: int) -> int | None:
        return self._slot.get((layer, expert))

    def residents(self) -> dict[Expert, int]:
        return dict(self._slot)

    @abstractmethod
    def observe(self, used: Mapping[int, Sequence[int]]) -> list[Promotion]:
        """One step: layer -> ids its tokens selected (one per (token, k)); returns copies to start."""

    def warm_start(self, profile: Profile) -> list[Promotion]:
        """Fill each region of slots with the region's most used experts of `profile`."""
        self.check_profile(profile)
        promotions: list[Promotion] = []
        for slots, layers in self._regions():
            promotions += self._fill(slots, profile.top(layers, len(slots)))
        return promotions

    def _regions(self) -> list[tuple[range, tuple[int, ...]]]:
        return [(range(self.group.num_slots), self.group.layers)]

    def check_profile(self, profile: Profile) -> None:
        """Raises ValueError if `profile` names experts this group does not have."""
        for layer in self.group.layers:
            bad = [e for e in profile.layer_counts(layer) if e >= self.group.num_experts]
            if bad:
                raise ValueError(
                    f"profile names experts {bad} of layer {layer}, which has {self.group.num_experts}"
                )

    def _fill(self, slots: range, wanted: Sequence[Expert]) -> list[Promotion]:
        keep = set(wanted)
        spare = sorted(
            (s for s in slots if self._held[s] not in keep), key=lambda s: self._held[s] is not None
        )
        missing = [e for e in wanted if e not in self._slot]
        return [self._place(s, e) for s, e in zip(spare, missing, strict=False)]

    def _empty_slot(self, slots: range) -> int | None:
        # NOTE: a slot never goes from held back to empty, so every slot before the cursor is held.
        cursor = self._cursor.get(slots.start, slots.start)
        while cursor < slots.stop and self._held[cursor] is not None:
            cursor += 1
        self._cursor[slots.start] = cursor
        return cursor if cursor < slots.stop else None

    def _place(self, slot: int, expert: Expert) -> Promotion:
        # NOTE: a slot holds at most one expert and an expert at most one slot.
        evicted = self._held[slot]
        if evicted is not None:
            del self._slot[evicted]
        self._held[slot] = expert
        self._slot[expert] = slot
        return Promotion(slot, expert[0], expert[1], evicted)

    def _used_ids(self, used: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for layer, layer_ids in used.items():
            ids = layer_ids.tolist() if isinstance(layer_ids, np.ndarray) else [int(e) for e in layer_ids]
            if layer not in self._layers:
                raise ValueError(f"layer {layer} is not in group {self.group.group_id}")
            if ids and not 0 <= min(ids) <= max(ids) < self.group.num_experts:
                raise ValueError(f"layer {layer}: expert ids {ids} outside [0, {self.group.num_experts})")
            out[layer] = ids
        return out


class LruPolicy(CachePolicy):
    name = "lru"

    def __init__(self, group: GroupPlan, config: PolicyConfig) -> None:
        super().__init__(group, config)
        self._recency: OrderedDict[Expert, None] = OrderedDict()  # least recently used first

    def observe(self, used: Mapping[int, Sequence[int]]) -> list[Promotion]:
        uses = Counter((layer, e) for layer, ids in self._used_ids(used).items() for e in ids)
        hits = [e for e in uses if e in self._slot]
        for expert in hits:
            self._recency.move_to_end(expert)
        # NOTE: room excludes this step's hits, so no expert used in the step is evicted.
        room = max(self.group.num_slots - len(hits), 0)
        misses = [e for e in uses if e not in self._slot]
        if len(misses) > room:
            misses.sort(key=uses.__getitem__, reverse=True)  # most used in the step first, stable
        return [self._place(self._victim(), expert) for expert in misses[:room]]

    def warm_start(self, profile: Profile) -> list[Promotion]:
        promotions = super().warm_start(profile)
        for expert in reversed(profile.top(self.group.layers, self.group.num_slots)):
            self._recency.move_to_end(expert)  # the hottest becomes the most recent
        return promotions

    def _victim(self) -> int:
        empty = self._empty_slot(range(self.group.num_slots))
        return empty if empty is not None else self._slot[next(iter(self._recency))]

    def _place(self, slot: int, expert: Expert) -> Promotion:
        promotion = super()._place(slot, expert)
        if promotion.evicted is not None:
            del self._recency[promotion.evicted]
        self._recency[expert] = None
        return promotion


@dataclass(frozen=True)
class _Offer:
    """A missed expert and the slot it would take; empty-slot fills sort first, then by key."""

    is_replacement: bool
    key: float  # smaller first: -score for an empty slot, -(score gain) for a replacement
    layer: int
    slot: int
    expert: int


class ScoredPolicy(CachePolicy):
    """Per-layer slots ranked by a score per expert; subclasses say how scores move and compare."""

    def __init__(self, group: GroupPlan, config: PolicyConfig) -> None:
        super().__init__(group, config)
        self._layer_slots = layer_slots(group)
        self._scores = {layer: np.zeros(group.num_experts) for layer in group.layers}  # [num_experts]
        self._held_ids = {layer: np.full(len(r), -1) for layer, r in self._layer_slots.items()}  # [slots]

    def score(self, layer: int, expert: int) -> float:
        return float(self._scores[layer][expert])

    @abstractmethod
    def _update(self, scores: np.ndarray, uses: np.ndarray, num_tokens: int) -> None:
        """Scores `[num_experts]` in place after a step with `uses [num_experts]` of `num_tokens`."""

    @abstractmethod
    def _beats(self, candidate: float, resident: float) -> bool: ...

    @abstractmethod
    def _seed_scale(self) -> float:
        """Score of an expert used once per token, at one token per step (the warm-start unit)."""

    def _start_step(self) -> None:
        """Hook run before a step's scores are updated."""

    def observe(self, used: Mapping[int, Sequence[int]]) -> list[Promotion]:
        ids = self._used_ids(used)
        self._start_step()
        offers: list[_Offer] = []
        for layer, layer_ids in ids.items():
            uses = np.bincount(np.asarray(layer_ids, dtype=np.int64), minlength=self.group.num_experts)
            self._update(self._scores[layer], uses, math.ceil(len(layer_ids) / self.group.top_k))
            offers += self._offers(layer, set(layer_ids))
        # NOTE: within a layer keys never decrease, so the cut keeps each layer's best offers.
        offers.sort(key=lambda o: (o.is_replacement, o.key))
        return [self._place(o.slot, (o.layer, o.expert)) for o in offers[: self.config.promote_per_step]]

    def _offers(self, layer: int, used: set[int]) -> list[_Offer]:
        scores, held, slots = self._scores[layer], self._held_ids[layer], self._layer_slots[layer]
        missed = sorted((e for e in used if (layer, e) not in self._slot), key=lambda e: (-scores[e], e))
        weakest = np.argsort(np.where(held >= 0, scores[held], -np.inf), kind="stable")  # empty first
        offers = []
        for expert, index in zip(missed, weakest.tolist(), strict=False):
            if held[index] < 0:
                offers.append(_Offer(False, -scores[expert], layer, slots[index], expert))
            elif self._beats(scores[expert], scores[held[index]]):
                offers.append(_Offer(True, scores[held[index]] - scores[expert], layer, slots[index], expert))
            else:
                break
        return offers

    def _regions(self) -> list[tuple[range, tuple[int, ...]]]:
        return [(slots, (layer,)) for layer, slots in self._layer_slots.items()]

    def _place(self, slot: int, expert: Expert) -> Promotion:
        layer, index = expert[0], slot - self._layer_slots[expert[0]].start
        self._held_ids[layer][index] = expert[1]
        return super()._place(slot, expert)

    def warm_start(self, profile: Profile) -> list[Promotion]:
        """Seeds each layer's scores with the profile's uses per token, then fills its slots."""
        self.check_profile(profile)
        for layer in self.group.layers:
            counts = profile.layer_counts(layer)
            num_tokens = sum(counts.values()) / self.group.top_k
            if num_tokens > 0:
                self._scores[layer] = np.zeros(self.group.num_experts)
                for expert, n in counts.items():
                    self._scores[layer][expert] = n / num_tokens * self._seed_scale()
        return super().warm_start(profile)


class DecayPolicy(ScoredPolicy):
    name = "decay"

    def _update(self, scores: np.ndarray, uses: np.ndarray, num_tokens: int) -> None:
        scores *= self.config.decay**num_tokens
        scores += uses

    def _beats(self, candidate: float, resident: float) -> bool:
        return candidate > resident

    def _seed_scale(self) -> float:
        return 1.0 / (1.0 - self.config.decay)  # steady state of s <- decay * s + 1


class LfruPolicy(ScoredPolicy):
    name = "lfru"

    def __init__(self, group: GroupPlan, config: PolicyConfig) -> None:
        super().__init__(group, config)
        self._steps = 0

    def _start_step(self) -> None:
        if self._steps and self._steps % self.config.lfru_halve_every == 0:
            for scores in self._scores.values():
                scores *= 0.5
        self._steps += 1

    def _update(self, scores: np.ndarray, uses: np.ndarray, num_tokens: int) -> None:
        scores += uses

    def _beats(self, candidate: float, resident: float) -> bool:
        return candidate > self.config.lfru_margin * resident

    def _seed_scale(self) -> float:
        return float(self.config.lfru_halve_every)  # uses over one halving period


class StaticPolicy(CachePolicy):
    """The group's most used experts of a profile (one pool), filled by `warm_start`, then fixed."""

    name = "static"
    needs_profile = True

    def observe(self, used: Mapping[int, Sequence[int]]) -> list[Promotion]:
        self._used_ids(used)
        return []


_POLICY_TYPES: dict[str, type[CachePolicy]] = {
    cls.name: cls for cls in (LruPolicy, DecayPolicy, LfruPolicy, StaticPolicy)
}
POLICIES: tuple[str, ...] = tuple(_POLICY_TYPES)


def make_policy(
    name: str, group: GroupPlan, config: PolicyConfig, profile: Profile | None = None
) -> CachePolicy:
    """An empty policy for `group`. The caller warm-starts it (`warm_start(profile)`) and uploads the
    returned promotions; `profile` is checked here so a missing or mismatched one fails at startup."""
    if name not in _POLICY_TYPES:
        raise ValueError(f"unknown cache policy {name!r}; one of {', '.join(POLICIES)}")
    policy = _POLICY_TYPES[name](group, config)
    if policy.needs_profile and profile is None:
        raise ValueError(f"{name} policy needs --cache-profile")
    if profile is not None:
        policy.check_profile(profile)
    return policy
