"""Where routed experts live: resident on the device, in host RAM behind the cache, or on disk (the GGUF file)
behind a host-RAM tier and the cache. Torch-free."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from engine.config import CacheConfig
from engine.layer_split import split_budget

MiB = 1 << 20


@dataclass(frozen=True)
class Placement:
    host_layers: tuple[int, ...]  # MoE layers whose routed experts live in host RAM
    resident_layers: tuple[int, ...]  # MoE layers whose routed experts live on the device
    budget_bytes: int  # the expert cache for the host layers
    reason: str  # one line for the startup log
    disk_layers: tuple[int, ...] = ()  # host layers whose routed experts stay on disk behind the RAM tier

    def is_host(self, layer: int) -> bool:
        return layer in self.host_layers


def choose_placement(layer_bytes: Mapping[int, int], cfg: CacheConfig, free_bytes: int | None,
                     reserved_bytes: int = 0, moe_layers: Sequence[int] | None = None) -> Placement:
    """layer_bytes: MoE layer -> bytes of its routed experts. free_bytes: free device memory, None when
    the device is the CPU (nothing to cache into unless a budget is given). moe_layers: every MoE layer of the model
    where `layer_bytes` holds one device's (a split model: the first N of --n-cpu-moe and --n-ssd-moe are the
    model's)."""
    layers = sorted(layer_bytes)
    every = sorted(moe_layers) if moe_layers is not None else layers
    if cfg.cpu_moe:
        host, why = layers, "--cpu-moe: every routed expert in host RAM"
    elif cfg.n_cpu_moe:
        host = [x for x in every[:cfg.n_cpu_moe] if x in layer_bytes]
        why = f"--n-cpu-moe {cfg.n_cpu_moe}: the first MoE layers in host RAM"
    elif free_bytes is None:
        host, why = [], "the device is the CPU: routed experts computed in place"
    elif _fits(layer_bytes, free_bytes, reserved_bytes, cfg):
        host, why = [], "all routed experts fit on the device"
    else:
        host, why = layers, "routed experts do not fit on the device: host RAM + expert cache"
    disk = layers if cfg.ssd_moe else [x for x in every[:cfg.n_ssd_moe] if x in layer_bytes]
    if disk:  # NOTE: a layer on disk is a host layer: the RAM tier and the cache are in front of it
        also = f"; {why}" if host else ""
        host, why = sorted(set(host) | set(disk)), f"{_disk_flag(cfg)}: {len(disk)} layers' routed experts on " \
            f"disk behind host RAM{also}"
    resident = [layer for layer in layers if layer not in host]
    budget = _budget(cfg, free_bytes, reserved_bytes + sum(layer_bytes[x] for x in resident)) if host else 0
    return Placement(tuple(host), tuple(resident), budget, why, tuple(disk))


def _disk_flag(cfg: CacheConfig) -> str:
    return "--ssd-moe" if cfg.ssd_moe else f"--n-ssd-moe {cfg.n_ssd_moe}"


def _fits(layer_bytes: Mapping[int, int], free: int, reserved: int, cfg: CacheConfig) -> bool:
    return sum(layer_bytes.values()) <= free - reserved - cfg.headroom_mib * MiB


def _budget(cfg: CacheConfig, free: int | None, used: int) -> int:
    if cfg.budget_mib is not None:
        return cfg.budget_mib * MiB
    if free is None:
        return 0
    return max(0, free - used - cfg.headroom_mib * MiB)


def place_on_devices(layer_bytes: Mapping[int, int], cfg: CacheConfig, parts: Sequence[Sequence[int]],
                     free_bytes: Sequence[int | None], reserved_bytes: Sequence[int]) -> tuple[Placement, ...]:
    """One placement a device (a split model): `parts` are the MoE layers of each device, each placed against its
    own free memory. A given budget (--moe-cache-mib) is split across the devices in proportion to the host expert
    bytes of their layers; an automatic one is each device's own free memory."""
    placements = tuple(choose_placement({x: layer_bytes[x] for x in part}, cfg, free, reserved, list(layer_bytes))
                       for part, free, reserved in zip(parts, free_bytes, reserved_bytes, strict=True))
    if cfg.budget_mib is None or len(placements) == 1:
        return placements
    host = [sum(layer_bytes[x] for x in p.host_layers) for p in placements]
    return tuple(replace(p, budget_bytes=b) for p, b in zip(placements, split_budget(cfg.budget_mib * MiB, host),
                                                            strict=True))


def merge_placements(placements: Sequence[Placement], labels: Sequence[str]) -> Placement:
    """The devices' placements as one (the model's: its host, resident and disk layers, the whole budget); the
    reason names each device's where they differ."""
    if len(placements) == 1:
        return placements[0]
    reasons = {p.reason for p in placements}
    reason = reasons.pop() if len(reasons) == 1 else \
        "; ".join(f"{label}: {p.reason}" for label, p in zip(labels, placements, strict=True))
    return Placement(tuple(sorted(x for p in placements for x in p.host_layers)),
                     tuple(sorted(x for p in placements for x in p.resident_layers)),
                     sum(p.budget_bytes for p in placements), reason,
                     tuple(sorted(x for p in placements for x in p.disk_layers)))
