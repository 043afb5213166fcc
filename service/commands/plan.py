"""`moecache plan`: how a model's routed experts would be placed and cached for a budget, and with a
recorded routing trace, the hit rate each policy would get (replayed through the real policy code); the
KV cache the context, sequences and K / V types take beside it. With several devices (`--devices`), each device's
layers, cache and KV cache: the budget split in proportion to the host expert bytes of each device's layers."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

import torch

from engine.arch import get_arch
from engine.arch.base import layer_tensor
from engine.config import POLICIES, CacheConfig, ModelConfig, SchedulerConfig
from engine.expert_cache.placement import MiB
from engine.expert_cache.plan import CachePlan, LayerExperts, merge_plans, plan_devices, smallest_split_budget
from engine.expert_cache.policy import PolicyConfig
from engine.expert_cache.ram_tier import ram_tier_slots
from engine.expert_cache.replay import profile_from_trace, replay
from engine.gguf.reader import GGUFFile
from engine.kv_cache import kv_cache_bytes
from engine.layer_split import LayerSplit, split_budget, split_layers
from engine.trace import RoutingTrace
from ops.bank import expert_bytes
from service.options import add_options, default_of


def register(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="show the expert cache a budget gives a model (and predicted hit rates)")
    p.add_argument("model", help="GGUF file")
    p.add_argument("--mib", type=int, default=None, help="cache budget (default: a sweep of budgets)")
    p.add_argument("--n-cpu-moe", type=int, default=default_of(CacheConfig, "n_cpu_moe"), metavar="N",
                   help="only the first N MoE layers in host RAM")
    p.add_argument("--host-cache-mib", type=int, default=None, metavar="MIB",
                   help="what a host-RAM tier of MIB holds with the experts on disk (--ssd-moe)")
    p.add_argument("--trace", default=None, help="a routing trace (--record-trace) to replay through each policy")
    p.add_argument("--max-cached-batch", type=int, default=default_of(CacheConfig, "max_cached_batch"))
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    kv = p.add_argument_group("KV cache (bf16 activations, as on CUDA)")
    add_options(kv, ModelConfig, ("max_context", "kv_cache_dtype", "cache_type_k", "cache_type_v"))
    add_options(kv, SchedulerConfig, ("max_num_seqs",))
    devices = p.add_argument_group("several devices (the layers split evenly unless --tensor-split)")
    add_options(devices, ModelConfig, ("devices", "tensor_split"))
    p.set_defaults(run=run)
    return p


def host_layers(gguf: GGUFFile, n_cpu_moe: int) -> list[LayerExperts]:
    arch = get_arch(gguf.architecture)
    num_layers, top_k = gguf.require(arch.key("block_count")), gguf.require(arch.key("expert_used_count"))
    layers = []
    for i in range(num_layers):
        # gate and up separate, or merged (Gemma 4's ffn_gate_up_exps, gate rows first)
        roles = ("gate_up_exps",) if gguf.has(layer_tensor(i, "gate_up_exps")) else ("gate_exps", "up_exps")
        if not gguf.has(layer_tensor(i, roles[0])):
            continue
        infos = [gguf.tensor(layer_tensor(i, role)) for role in (*roles, "down_exps")]
        gate, up, down = infos if len(infos) == 3 else (infos[0], *infos)
        num_experts, ff, hidden = gate.shape[0], gate.shape[1] // (2 if len(infos) == 2 else 1), gate.shape[2]
        per_expert = expert_bytes(gate.qtype, up.qtype, down.qtype, hidden, ff)
        key = tuple((t.qtype.name, t.shape[1:]) for t in infos)
        layers.append(LayerExperts(i, num_experts, top_k, per_expert, key))
    return layers[:n_cpu_moe] if n_cpu_moe else layers


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The options as the engine's config (checked as the engine checks them)."""
    return ModelConfig(max_context=args.ctx_size, kv_cache_dtype=args.kv_cache_dtype, cache_type_k=args.cache_type_k,
                       cache_type_v=args.cache_type_v, devices=args.devices, tensor_split=args.tensor_split)


def layer_split(gguf: GGUFFile, model: ModelConfig) -> LayerSplit:
    """The devices' ranges of layers: one device's all of them; several split by --tensor-split, else evenly."""
    num_layers = gguf.require(get_arch(gguf.architecture).key("block_count"))
    names = model.device_names if model.devices is not None else ("device",)
    shares = model.split_shares or (1.0,) * len(names)
    return LayerSplit(names, split_layers(num_layers, shares), num_layers)


def kv_cache(gguf: GGUFFile, model: ModelConfig, args: argparse.Namespace, layers: range | None = None) -> dict:
    """The engine's KV cache for the options (of `layers` only: one device's): its bytes, types and dimensions."""
    hp = get_arch(gguf.architecture).hparams(gguf.metadata, vocab_size=0)  # the vocabulary does not size it
    positions = min(model.max_context, hp.context_length)
    k_type, v_type = model.kv_types
    # one slot per sequence, plus the engine's scratch slot
    size = kv_cache_bytes(hp, args.max_num_seqs + 1, positions, torch.bfloat16, k_type, v_type, layers)
    return {"bytes": size, "k_type": k_type, "v_type": v_type, "positions": positions,
            "sequences": args.max_num_seqs}


def describe(plan: CachePlan, parts: list[list[LayerExperts]], max_batch: int, kv_bytes: int) -> dict:
    smallest = smallest_split_budget(parts)
    groups = [{**asdict(g), "cache_bytes": g.cache_bytes, "share": g.share, "largest_cached_batch": max_batch}
              for g in plan.groups]
    return {"budget_mib": plan.budget_bytes // MiB, "cache_bytes": plan.cache_bytes, "share": plan.share,
            "device_bytes": plan.cache_bytes + kv_bytes, "smallest_useful_mib": smallest // MiB, "groups": groups,
            "warnings": list(plan.warnings)}


def describe_devices(split: LayerSplit, plans: tuple[CachePlan, ...], parts: list[list[LayerExperts]],
                     kv: list[dict]) -> list[dict]:
    """Each device's layers, host expert bytes, share of the budget, cache and KV cache."""
    return [{"device": label, "layers": [r.start, r.stop - 1],
             "host_expert_bytes": sum(x.expert_bytes * x.num_experts for x in part),
             "budget_bytes": plan.budget_bytes, "cache_bytes": plan.cache_bytes, "slots": plan.num_slots,
             "share": plan.share, "kv_bytes": device_kv["bytes"], "device_bytes": plan.cache_bytes + device_kv["bytes"]}
            for label, r, plan, part, device_kv in zip(split.labels, split.ranges, plans, parts, kv, strict=True)]


def ram_tier(layers: list[LayerExperts], budget_mib: int) -> dict:
    """The host-RAM tier of `--ssd-moe` for a budget: its slots (of the largest expert) and their share."""
    slot_bytes = max((x.expert_bytes for x in layers), default=0)
    total = sum(x.num_experts for x in layers)
    slots = ram_tier_slots(budget_mib * MiB, slot_bytes, total) if slot_bytes else 0
    top_k = max((x.top_k for x in layers), default=0)
    return {"budget_mib": budget_mib, "slot_bytes": slot_bytes, "slots": slots, "share": slots / total if total else 0,
            "fits_a_token": slots >= top_k}


def plan_split(parts: list[list[LayerExperts]], budget: int, split: LayerSplit) -> tuple[CachePlan, ...]:
    """Each device's plan: the budget split in proportion to its layers' host expert bytes."""
    host = [sum(x.expert_bytes * x.num_experts for x in part) for part in parts]
    return plan_devices(parts, split_budget(budget, host), split.labels)


def predicted_hit_rates(trace_path: str, plan: CachePlan) -> dict[str, float]:
    trace = RoutingTrace.load(trace_path)
    rates = {}
    for policy in POLICIES:
        profile = profile_from_trace(trace) if policy == "static" else None
        rates[policy] = replay(trace, plan, policy, PolicyConfig(), profile).hit_ratio
    return rates


def budgets(args: argparse.Namespace, parts: list[list[LayerExperts]]) -> list[int]:
    layers = [x for part in parts for x in part]
    if args.mib is not None:
        return [args.mib * MiB]
    if not layers:
        return [0]
    total = sum(x.expert_bytes * x.num_experts for x in layers)
    smallest = smallest_split_budget(parts)
    fractions = [smallest] + [int(total * f) // MiB * MiB for f in (0.05, 0.1, 0.25, 0.5, 1.0)]
    return sorted({b for b in fractions if b >= smallest})


def run(args: argparse.Namespace) -> int:
    gguf, model = GGUFFile(args.model), model_config(args)
    layers, split = host_layers(gguf, args.n_cpu_moe), layer_split(gguf, model)
    parts = [[x for x in layers if x.layer in r] for r in split.ranges]
    kv = kv_cache(gguf, model, args)
    device_kv = [kv_cache(gguf, model, args, r) for r in split.ranges]
    results = []
    for budget in budgets(args, parts):
        plans = plan_split(parts, budget, split)
        plan = merge_plans(plans)
        result = describe(plan, parts, args.max_cached_batch, kv["bytes"])
        if model.devices is not None:
            result["devices"] = describe_devices(split, plans, parts, device_kv)
        if args.trace:
            result["predicted_hit_ratio"] = predicted_hit_rates(args.trace, plan)
        results.append(result)
    host_bytes = sum(x.expert_bytes * x.num_experts for x in layers)
    tier = ram_tier(layers, args.host_cache_mib) if args.host_cache_mib is not None else None
    if args.json:
        json.dump({"model": str(gguf.path), "host_expert_bytes": host_bytes, "kv_cache": kv, "plans": results,
                   **({"ram_tier": tier} if tier else {})}, sys.stdout, indent=2)
        print()
    else:
        print_table(gguf, layers, host_bytes, kv, results)
        if tier:
            print(f"\nhost-RAM tier (--ssd-moe) {tier['budget_mib']} MiB: {tier['slots']} experts of "
                  f"{tier['slot_bytes'] / MiB:.2f} MiB, {tier['share']:.1%} of the experts on disk"
                  + ("" if tier["fits_a_token"] else "; fewer than a token selects: too small"))
    return 0


def print_table(gguf: GGUFFile, layers: list[LayerExperts], host_bytes: int, kv: dict, results: list[dict]) -> None:
    print(f"{gguf.path}: {len(layers)} MoE layers with experts in host RAM, {host_bytes / 2**30:.2f} GiB of "
          f"routed experts; smallest useful cache {results[0]['smallest_useful_mib']} MiB")
    print(f"KV cache: {kv['bytes'] / MiB:.0f} MiB (K {kv['k_type']}, V {kv['v_type']}; {kv['sequences']} sequences "
          f"of {kv['positions']} positions)")
    for r in results:
        print(f"\nbudget {r['budget_mib']} MiB -> cache {r['cache_bytes'] / MiB:.0f} MiB, "
              f"{r['share']:.1%} of host experts; with the KV cache {r['device_bytes'] / MiB:.0f} MiB")
        print(f"  {'group':>5} {'layers':>10} {'slot MiB':>9} {'slots':>6} {'share':>7} {'max batch':>9}")
        for g in r["groups"]:
            span = f"{g['layers'][0]}-{g['layers'][-1]}" if g["layers"] else "-"
            print(f"  {g['group_id']:>5} {span:>10} {g['slot_bytes'] / MiB:>9.2f} {g['num_slots']:>6} "
                  f"{g['share']:>7.1%} {g['largest_cached_batch']:>9}")
        for d in r.get("devices", ()):
            print(f"  {d['device']}: layers {d['layers'][0]}-{d['layers'][1]}, budget {d['budget_bytes'] / MiB:.0f} "
                  f"MiB -> cache {d['cache_bytes'] / MiB:.0f} MiB, {d['slots']} slots ({d['share']:.1%} of its host "
                  f"experts); with its KV cache {d['device_bytes'] / MiB:.0f} MiB")
        for warning in r["warnings"]:
            print(f"  warning: {warning}")
        if "predicted_hit_ratio" in r:
            print("  predicted hit ratio: " + ", ".join(f"{k} {v:.1%}" for k, v in r["predicted_hit_ratio"].items()))

