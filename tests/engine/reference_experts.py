"""The no-cache reference of the MoE block's experts: the executor the engine's paths are checked against."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.moe import flatten_pairs
from ops.bank import ExpertWeights
from ops.expert_ffn import expert_ffn_reference


class ReferenceExperts:
    """`ops.expert_ffn.expert_ffn_reference` on each layer's bank: an `engine.moe.ExpertExecutor`. Experts
    may live anywhere (host map, device); the math runs on x's device."""

    def __init__(self, experts: Mapping[int, ExpertWeights]) -> None:
        self.experts = experts

    def __call__(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        tokens, experts, pair_weights = flatten_pairs(expert_ids, weights)
        return expert_ffn_reference(x, tokens, experts, pair_weights, self.experts[layer]).to(x.dtype)
