"""Hit ratio of the host-RAM tier (`engine.expert_cache.ram_tier.SlotLru`) behind a 25% VRAM cache, replaying the shape
of `.ci/gpu-final.sh 6`'s on-disk run through the policy code: 48 layers x 128 experts, top-8, `tools.routing`'s qwen3
model; per run a 64-token prompt (a batch of more than 32 tokens: it uses the VRAM cache without changing it), a new
request's 16-token prompt and its decode steps (a warm-up run of 100, then the measured run of 64). The tier sees each
layer's VRAM misses, as `RamTier.load` does, and holds 25% of the experts. Beside it, the same tier made exclusive of
the VRAM (a model: an expert the VRAM evicts is copied back into the tier as its most recent, an expert that lands in
the VRAM goes first from the tier), and what a tier as good as the VRAM cache's second quarter would hit: (hit of a
50% VRAM cache - hit of the 25% one) / (1 - hit of the 25% one), over the same decode steps; and the VRAM's evictions
a decode step (the copies back an exclusive tier would make). Means of three seeds.
Usage: python3 .ci/ram-tier-replay.py [POLICY ...]   (default: lru decay)"""

import sys

import numpy as np

from engine.expert_cache.plan import GroupPlan
from engine.expert_cache.policy import PolicyConfig, make_policy
from engine.expert_cache.ram_tier import SlotLru
from engine.expert_cache.replay import DeviceModel
from tools.routing import LOCALITY_MODELS, SyntheticSource

LAYERS, EXPERTS, TOP_K, SEEDS = 48, 128, 8, (0, 1, 2)
QUARTER = LAYERS * EXPERTS // 4
RUNS = (("warm-up", 100, False), ("measured", 64, True))  # (request, decode steps, measured)


def steps(source: SyntheticSource, request: str, decode: int) -> list[np.ndarray]:
    """[layers, tokens, top_k] a step: bench's prompt, the decoding request's prompt, its decode tokens."""
    prompt = np.concatenate([source.route([request + " prompt"]) for _ in range(64)], axis=1)
    first = np.concatenate([source.route([request]) for _ in range(16)], axis=1)
    return [prompt, first] + [source.route([request]) for _ in range(decode)]


def replay(policy: str, seed: int, vram_slots: int, tier: SlotLru | None,
           exclusive: bool = False) -> tuple[float, float, float]:
    """(VRAM hit ratio, RAM-tier hit ratio, VRAM evictions a step) over the measured run's decode steps."""
    source = SyntheticSource(LOCALITY_MODELS["qwen3"], LAYERS, EXPERTS, TOP_K, seed=seed)
    group = GroupPlan(0, tuple(range(LAYERS)), EXPERTS, TOP_K, 1, vram_slots)
    device = DeviceModel(make_policy(policy, group, PolicyConfig(), None))
    used_total = vram_hits = tier_hits = tier_misses = evictions = decode_steps = 0
    for request, decode, measured in RUNS:
        for i, ids in enumerate(steps(source, request, decode)):
            used = {layer: sorted(set(ids[layer].reshape(-1).tolist())) for layer in range(LAYERS)}
            misses = {layer: [e for e in used[layer] if (layer, e) not in device.published] for layer in used}
            missed_in_ram = sum(len(tier.place([(layer, e) for e in m])[1]) for layer, m in misses.items()) \
                if tier is not None else 0
            before = set(device.published)
            if ids.shape[1] <= 32:  # larger batches use the VRAM cache without changing it
                device.step(used)
            evicted, landed = before - set(device.published), set(device.published) - before
            if exclusive and tier is not None:
                for layer in range(LAYERS):  # a layer at a time, as the tier is filled
                    tier.place([key for key in evicted if key[0] == layer])
                tier.demote(list(landed))
            if measured and i >= 2:  # the decode steps
                num_misses = sum(map(len, misses.values()))
                used_total += sum(map(len, used.values()))
                vram_hits += sum(map(len, used.values())) - num_misses
                tier_hits += num_misses - missed_in_ram
                tier_misses += missed_in_ram
                evictions += len(evicted)
                decode_steps += 1
    return vram_hits / used_total, tier_hits / max(1, tier_hits + tier_misses), evictions / decode_steps


def main() -> None:
    for policy in sys.argv[1:] or ["lru", "decay"]:
        inclusive = np.mean([replay(policy, s, QUARTER, SlotLru(QUARTER)) for s in SEEDS], axis=0)
        exclusive = np.mean([replay(policy, s, QUARTER, SlotLru(QUARTER), True) for s in SEEDS], axis=0)
        half = np.mean([replay(policy, s, 2 * QUARTER, None)[0] for s in SEEDS])
        second_quarter = (half - inclusive[0]) / (1 - inclusive[0])
        print(f"{policy}: VRAM 25% hits {inclusive[0]:.3f}; the LRU RAM tier of 25% behind it {inclusive[1]:.3f}, "
              f"exclusive of the VRAM {exclusive[1]:.3f} ({exclusive[2]:.1f} VRAM evictions a decode step); "
              f"VRAM 50% hits {half:.3f}, a tier as good as its second quarter {second_quarter:.3f}")


if __name__ == "__main__":
    main()
