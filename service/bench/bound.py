"""The lower bound on the time of one decode token (batch 1), from the bytes it reads and the ceilings:

    t_bound = max(t_gpu_floor, miss_bytes / (link + cpu_experts))
    t_gpu_floor = (dense bytes + hit expert bytes) / HBM
    miss_bytes = (1 - hit_ratio) x bytes of the experts a token selects in the host-RAM layers

Hit expert bytes are the cached share of those selected host experts plus the selected experts of the
layers resident on the device: both are read from device memory.

The link and the CPU read the same host memory. Where the ceilings hold their rates measured at once (on CUDA),
the host's bound puts those in the sum instead, `miss_bytes / (link_at_once + cpu_at_once)`: what the host's
memory gives the two readers together (docs/benchmarks.md, "The bound beside each figure").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, fields, is_dataclass

import torch

from engine.weights import ModelWeights
from ops.bank import ExpertWeights
from service.bench.ceilings import Ceilings


@dataclass(frozen=True)
class TokenBytes:
    """Bytes one decode token reads, by where they live."""

    dense: int  # every loaded weight but the routed experts and the embedding table (one row is read)
    host_experts: int  # the experts a token selects in the host-RAM layers: sum of top_k x expert bytes
    resident_experts: int  # the same for the layers whose experts are resident on the device


@dataclass(frozen=True)
class Bound:
    seconds: float
    gpu_floor_seconds: float
    miss_seconds: float
    miss_bytes: float
    host_seconds: float | None = None  # the bound with the link's and the CPU's rates at once; None: not measured

    @property
    def tokens_per_second(self) -> float:
        return 1.0 / self.seconds

    def share_of(self, tokens_per_second: float) -> float:
        """t_bound / t_measured: how close a measured decode speed comes to the bound."""
        return tokens_per_second * self.seconds

    def host_share_of(self, tokens_per_second: float) -> float | None:
        """t_host_bound / t_measured, where the at-once rates were measured."""
        return None if self.host_seconds is None else tokens_per_second * self.host_seconds


def _tensors(items: Iterable[object]) -> Iterator[torch.Tensor]:
    for item in items:
        if isinstance(item, torch.Tensor):
            yield item
        elif is_dataclass(item) and not isinstance(item, ExpertWeights):
            yield from _tensors(getattr(item, f.name) for f in fields(item))


def dense_bytes(weights: ModelWeights) -> int:
    """Loaded bytes of the weights a token reads in full (a tied output matrix counted once)."""
    unique = {id(t): t.numel() * t.element_size() for t in _tensors([weights.norm, weights.output,
                                                                      *weights.layers])}
    return sum(unique.values())


def token_bytes(weights: ModelWeights, expert_bytes: Mapping[int, int],
                host_layers: Iterable[int]) -> TokenBytes:
    """expert_bytes: MoE layer -> bytes of one of its experts."""
    top_k, host = weights.hparams.top_k, set(host_layers)
    host_total = sum(top_k * n for layer, n in expert_bytes.items() if layer in host)
    resident_total = sum(top_k * n for layer, n in expert_bytes.items() if layer not in host)
    return TokenBytes(dense_bytes(weights), host_total, resident_total)


def decode_bound(token: TokenBytes, hit_ratio: float, ceilings: Ceilings) -> Bound:
    if not 0.0 <= hit_ratio <= 1.0:
        raise ValueError(f"hit ratio must be in [0, 1], got {hit_ratio}")
    hit_bytes = hit_ratio * token.host_experts + token.resident_experts
    miss_bytes = (1.0 - hit_ratio) * token.host_experts
    gpu_floor = (token.dense + hit_bytes) / (ceilings.hbm_gbps * 1e9)
    miss = miss_bytes / ((ceilings.link_gbps + ceilings.cpu_expert_gbps) * 1e9)
    host = None
    if ceilings.at_once_gbps is not None:
        host = max(gpu_floor, miss, miss_bytes / (sum(ceilings.at_once_gbps) * 1e9))
    return Bound(max(gpu_floor, miss), gpu_floor, miss, miss_bytes, host)
