"""Hit ratios of bench's measured request through the policy code, against an oracle: 48 layers x 128 experts,
top-8, `tools.routing`'s qwen3 model; a uniform warm start (`--cache-profile`), a 400-token request, then a new
request's 16-token prompt (one step) and its decode steps. For each budget: each policy's hit ratio over the first
63 decode steps (bench's `--gen-len 64`: the prompt step gives the first token) and the first 127 (`--gen-len 128`),
its first 8 steps against the rest, and Belady's (evict the expert used furthest ahead, decisions at once) over the
same 63; the means of three seeds. Usage: python3 .ci/policy-replay.py [POLICY ...]   (default: lru decay)"""

import sys

import numpy as np

from engine.expert_cache.plan import GroupPlan
from engine.expert_cache.policy import PolicyConfig, make_policy
from engine.expert_cache.profile import Profile
from engine.expert_cache.replay import DeviceModel
from tools.routing import LOCALITY_MODELS, SyntheticSource

LAYERS, EXPERTS, TOP_K, WARM, GEN, SEEDS = 48, 128, 8, 400, 128, (0, 1, 2)


def trace(seed: int) -> list[np.ndarray]:
    """[layers, tokens, top_k] a step: the warm-up request's tokens, the new prompt, its decode tokens."""
    source = SyntheticSource(LOCALITY_MODELS["qwen3"], LAYERS, EXPERTS, TOP_K, seed=seed)
    steps = [source.route(["warm"]) for _ in range(WARM)]
    steps.append(np.concatenate([source.route(["new"]) for _ in range(16)], axis=1))
    return steps + [source.route(["new"]) for _ in range(GEN)]


def policy_hits(name: str, share: float, steps: list[np.ndarray]) -> np.ndarray:
    """Hit ratio of each decode token of the new request."""
    group = GroupPlan(0, tuple(range(LAYERS)), EXPERTS, TOP_K, 1, int(share * LAYERS * EXPERTS))
    policy = make_policy(name, group, PolicyConfig(), None)
    device = DeviceModel(policy, uploads=policy.warm_start(Profile({layer: dict.fromkeys(range(EXPERTS), 1)
                                                                      for layer in range(LAYERS)})))
    hits = [device.step({layer: ids[layer].reshape(-1).tolist() for layer in range(LAYERS)})[0] for ids in steps]
    return np.array(hits[-GEN:]) / (LAYERS * TOP_K)


def belady_hits(share: float, steps: list[np.ndarray], measured: int) -> float:
    """The oracle's hit ratio over the first `measured` decode tokens."""
    uses = [{(layer, int(e)) for layer in range(LAYERS) for e in ids[layer].reshape(-1)} for ids in steps]
    next_use: list[dict[tuple[int, int], int]] = [{} for _ in uses]
    seen: dict[tuple[int, int], int] = {}
    for t in range(len(uses) - 1, -1, -1):
        next_use[t] = {x: seen.get(x, len(uses)) for x in uses[t]}
        seen.update(dict.fromkeys(uses[t], t))
    cache: set[tuple[int, int]] = set()
    ahead: dict[tuple[int, int], int] = {}
    hits = total = 0
    first = len(steps) - GEN
    for t, ids in enumerate(steps):
        if first <= t < first + measured:
            pairs = [(layer, int(e)) for layer in range(LAYERS) for e in ids[layer].reshape(-1)]
            hits, total = hits + sum(p in cache for p in pairs), total + len(pairs)
        ahead.update(next_use[t])
        cache |= uses[t]
        over = len(cache) - int(share * LAYERS * EXPERTS)
        if over > 0:
            cache -= set(sorted(cache - uses[t], key=lambda x: -ahead[x])[:over])
    return hits / total


if __name__ == "__main__":
    traces = [trace(seed) for seed in SEEDS]
    for share in (0.25, 0.5):
        for name in sys.argv[1:] or ["lru", "decay"]:
            runs = np.stack([policy_hits(name, share, steps) for steps in traces])  # [seeds, tokens]
            print(f"{share:.0%} {name}: 63 tokens {runs[:, :63].mean():.1%}, 127 tokens {runs[:, :127].mean():.1%}; "
                  f"first 8 {runs[:, :8].mean():.1%}, the rest {runs[:, 8:].mean():.1%}", flush=True)
        print(f"{share:.0%} belady: 63 tokens "
              f"{np.mean([belady_hits(share, steps, 63) for steps in traces]):.1%}", flush=True)
