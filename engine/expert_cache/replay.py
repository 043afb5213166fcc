"""Replay a routing trace through the real policy code to predict hit rates (`moecache plan --trace`).

One trace token is one decode step. Copies complete at once: a promotion is a hit from the next step
on. A (token, k) pick is a hit when `slot_of` says its expert was resident before the step. Only the
plan's layers (routed experts in host RAM) count; a group without slots misses every pick.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from engine.expert_cache.plan import CachePlan
from engine.expert_cache.policy import CachePolicy, PolicyConfig, make_policy
from engine.expert_cache.profile import Profile
from engine.routing import RoutingTrace


@dataclass(frozen=True)
class ReplayResult:
    hit_ratio: float  # over every pick of the plan's layers
    per_group: dict[int, float]  # group_id -> hit ratio
    promotions: int  # copies started during the trace (a warm-start fill not counted)


def profile_from_trace(trace: RoutingTrace) -> Profile:
    """Use counts of every trace layer, e.g. to warm-start a replay of another trace."""
    profile = Profile()
    for axis, layer in enumerate(trace.layers):
        profile.add(layer, trace.expert_ids[:, axis].ravel().tolist())
    return profile


def _group_axes(trace: RoutingTrace, plan: CachePlan) -> dict[int, list[tuple[int, int]]]:
    """group_id -> [(trace axis, model layer)] for the plan's layers present in the trace."""
    axes: dict[int, list[tuple[int, int]]] = {}
    for axis, layer in enumerate(trace.layers):
        group = plan.group_of(layer)
        if group is None:
            continue
        if (group.num_experts, group.top_k) != (trace.num_experts, trace.top_k):
            raise ValueError(
                f"layer {layer}: trace has {trace.num_experts} experts, top-{trace.top_k}; "
                f"the plan has {group.num_experts}, top-{group.top_k}"
            )
        axes.setdefault(group.group_id, []).append((axis, layer))
    return axes


def _step(policy: CachePolicy, used: dict[int, list[int]]) -> tuple[int, int]:
    """(hits, promotions) of one step."""
    hits = sum(policy.slot_of(layer, e) is not None for layer, ids in used.items() for e in ids)
    return hits, len(policy.observe(used))


def replay(
    trace: RoutingTrace, plan: CachePlan, policy: str, config: PolicyConfig, profile: Profile | None = None
) -> ReplayResult:
    policies = {g.group_id: make_policy(policy, g, config, profile) for g in plan.groups if g.is_cached}
    if profile is not None:
        for cache_policy in policies.values():
            cache_policy.warm_start(profile)
    axes = _group_axes(trace, plan)
    hits: Counter[int] = Counter()
    promotions = 0
    for token in trace.expert_ids.tolist():  # [num_layers][top_k]
        for group_id, pairs in axes.items():
            if group_id in policies:
                step_hits, step_promotions = _step(
                    policies[group_id], {layer: token[a] for a, layer in pairs}
                )
                hits[group_id] += step_hits
                promotions += step_promotions
    picks = {g: len(pairs) * trace.num_tokens * trace.top_k for g, pairs in axes.items()}
    per_group = {g: hits[g] / n if n else 0.0 for g, n in picks.items()}
    total = sum(picks.values())
    return ReplayResult(sum(hits.values()) / total if total else 0.0, per_group, promotions)
