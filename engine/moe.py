"""The MoE block: router -> routed experts (through an executor that decides where each expert is
computed) -> weighted sum, plus the shared expert where the architecture has one."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.arch.base import Routing
from engine.layers import swiglu
from engine.weights import ModelWeights, MoE
from ops.fused import route_topk, route_topk_scored, routed_weights, routed_weights_scored


class Router(Protocol):
    """Chooses each token's experts from the router logits. The model's own is `TopKRouter`; benchmarks
    and trace replay install theirs (`tools.routing`), which may prepare each step's routing."""

    def __call__(self, moe_index: int, logits: torch.Tensor,
                 token_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits `[tokens, experts]` of the `moe_index`-th MoE layer -> expert ids (-1 where token_mask is
        False) and float32 weights `[tokens, top_k]`."""
        ...

    def begin_step(self, token_keys: Sequence[Hashable]) -> None:
        """Before a step's launch: the request of each of its tokens, in order."""
        ...

    def while_running(self) -> None:
        """After a step's launch, while the device computes: work that can be done ahead."""
        ...

    def release(self, request_id: Hashable) -> None:
        """A request finished."""
        ...


@dataclass(frozen=True)
class TopKRouter:
    """The model's router: scores over the experts (softmax, or DeepSeek-V3's sigmoid), top-k (within the
    best groups of experts, chosen on the scores plus the layer's correction bias where the model has
    them), optionally renormalised, scaled. Plain softmax top-k runs the fused router."""

    top_k: int
    norm_topk: bool
    routing: Routing = Routing()
    score_bias: tuple[torch.Tensor | None, ...] = ()  # per MoE layer: float32 [experts] or None

    @classmethod
    def of(cls, weights: ModelWeights) -> TopKRouter:
        hp = weights.hparams
        biases = tuple(layer.ffn.score_bias for layer in weights.layers if isinstance(layer.ffn, MoE))
        return cls(hp.top_k, hp.norm_topk, hp.routing, biases if any(b is not None for b in biases) else ())

    def __call__(self, moe_index: int, logits: torch.Tensor,
                 token_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        r, bias = self.routing, self.score_bias[moe_index] if self.score_bias else None
        if r.is_plain and bias is None:
            return route_topk(logits, self.top_k, self.norm_topk, token_mask)
        return route_topk_scored(logits, self.top_k, self.norm_topk, token_mask, sigmoid=r.gating == "sigmoid",
                                 score_bias=bias, num_groups=r.num_groups, topk_groups=r.topk_groups,
                                 group_by_max=r.group_score == "max", scale=r.scale)

    def weights_at(self, logits: torch.Tensor, expert_ids: torch.Tensor,
                   token_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights this router gives other ids (a routing trace's): `routed_weights`' contract."""
        if self.routing.is_plain:
            return routed_weights(logits, expert_ids, self.norm_topk, token_mask)
        return routed_weights_scored(logits, expert_ids, self.norm_topk, token_mask,
                                     sigmoid=self.routing.gating == "sigmoid", scale=self.routing.scale)

    def begin_step(self, token_keys: Sequence[Hashable]) -> None:
        pass

    def while_running(self) -> None:
        pass

    def release(self, request_id: Hashable) -> None:
        pass


class ExpertExecutor(Protocol):
    def __call__(self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor,
                 weights: torch.Tensor) -> torch.Tensor:
        """x `[tokens, hidden]`, expert_ids and weights `[tokens, top_k]` -> `sum_k w * expert_k(x)`."""
        ...


def moe_forward(moe_index: int, layer: int, x: torch.Tensor, w: MoE, router: Router, experts: ExpertExecutor,
                token_mask: torch.Tensor | None = None, router_x: torch.Tensor | None = None) -> torch.Tensor:
    """x `[tokens, hidden]` -> `[tokens, hidden]`; router_x: what the router reads where it is not x."""
    logits = F.linear(x if router_x is None else router_x, w.router, w.router_bias)  # [tokens, experts]
    # NOTE: padding rows of a captured batch (token_mask False) select no expert (id -1)
    expert_ids, weights = router(moe_index, logits, token_mask)
    if w.expert_scale is not None:
        weights = weights * w.expert_scale[expert_ids.clamp(min=0)]
    out = experts(layer, x, expert_ids, weights)
    if w.shared is None:
        return out
    shared = swiglu(x, w.shared)
    if w.shared_gate is not None:
        shared = torch.sigmoid(x @ w.shared_gate)[:, None] * shared  # [tokens, 1] gate
    return out + shared


def flatten_pairs(expert_ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`[tokens, top_k]` routing -> per-pair token ids, expert ids and weights `[tokens * top_k]`."""
    num_tokens, top_k = expert_ids.shape
    return pair_tokens(num_tokens, top_k, expert_ids.device), expert_ids.flatten(), weights.flatten().float()


_PAIR_TOKENS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def pair_tokens(num_tokens: int, top_k: int, device: torch.device) -> torch.Tensor:
    """0, 0, .., 1, 1, ..: the token of each pair, made once per shape and then read from memory (in a
    captured step: no launches). Read-only."""
    key = (num_tokens, top_k, device)
    tokens = _PAIR_TOKENS.get(key)
    if tokens is None:
        tokens = torch.arange(num_tokens, device=device).repeat_interleave(top_k)
        # NOTE: a tensor made during a capture holds its values only once the graph runs: never kept
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            if len(_PAIR_TOKENS) >= 64:  # prefill chunks of many sizes
                _PAIR_TOKENS.clear()
            _PAIR_TOKENS[key] = tokens
    return tokens
