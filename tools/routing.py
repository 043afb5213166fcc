"""Benchmark routing: a calibrated synthetic router, trace replay, and the router that replaces the model's.

A trace (`engine.trace.RoutingTrace`) holds the tokens of one stream in order. Traces come from a running
engine (`moecache serve --record-trace`) or from `synthetic_trace`, whose model families are calibrated to
published routing statistics:

- `qwen3` (Qwen3-30B-A3B, 128 experts, top-8): 45% of a token's experts at a layer were used by the
  previous token, 80% within 8 tokens, median reuse distance 2, mild popularity skew, and the cold-LRU
  hit-rate curve 6% -> 37%, 19% -> 74%, 38% -> 89%, 64% -> 96% of the experts cached per layer
  (measured on a 2,000-token stream, cache cold at its start).
- `mixtral` (Mixtral-8x7B, 8 experts, top-2): 45-50% of tokens share an expert with the previous token
  at layer 0 (chance: 46%), 62-67% in the middle layers (Jiang et al., "Mixtral of Experts", 2024,
  section 5).

The generator, per stream and layer, draws the token's top-k without replacement (Gumbel top-k) from
log-weights that add three parts:
- popularity: a fixed per-layer preference (mild: the most used expert gets ~5% of a layer's picks);
- a hot set per request drifting slowly: an affinity per expert follows an AR(1) walk; an expert's
  soft rank (share of experts with a higher affinity, in [0, 1]) costs `soft_rank / hot_width`;
- recency: an expert used `age` tokens ago gains `log(1 + recency_boost * recency_decay**(age - 1))`.
The whole log-weight is scaled by a layer strength that ramps from `first_layer_strength` at layer 0
to 1 over the first `ramp_fraction` of the layers: layer 0 routes near randomly, later layers stick.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.moe import Router, TopKRouter
from engine.trace import RoutingTrace
from engine.weights import ModelWeights

_LOGISTIC_PROBIT = 1.702  # logistic(1.702 x) approximates the normal CDF: soft rank ~ share above
_MAX_AGE = 64  # tokens; from here on an expert counts as never used (its bonus is below 1e-3)


@dataclass(frozen=True)
class LocalityModel:
    """Routing character of a model family; see the module docstring for the formula."""

    popularity_sigma: float  # std of the fixed per-layer log-popularity
    hot_width: float  # hot-set width as a share of the experts (never narrower than top_k)
    drift_tokens: float  # time constant of the hot-set drift
    recency_boost: float
    recency_decay: float
    first_layer_strength: float = 0.1
    ramp_fraction: float = 0.125


# Fitted by replaying 2,000-token streams (cold LRU per layer) against the figures above; see the tests.
LOCALITY_MODELS: dict[str, LocalityModel] = {
    "qwen3": LocalityModel(1.0, 0.115, 300.0, 2.8, 0.5),
    "mixtral": LocalityModel(0.3, 0.8, 300.0, 0.9, 0.5),
}


class RoutingSource(ABC):
    """Replaces the router in a benchmark: independent streams, each a request's tokens in order."""

    num_layers: int
    top_k: int

    def __init__(self) -> None:
        self._rows: dict[Hashable, int] = {}  # stream key -> state row
        self._free_rows: list[int] = []
        self._num_rows = 0
        self._num_created = 0

    def next_step(self, num_seqs: int) -> np.ndarray:
        """The next token of streams 0..num_seqs-1: `[num_layers, num_seqs, top_k]`."""
        return self.route(list(range(num_seqs)))

    def route(self, stream_keys: Sequence[Hashable]) -> np.ndarray:
        """One token per entry, `[num_layers, len(stream_keys), top_k]`; a key (e.g. a request id)
        names a stream, and its repeats within a call are its consecutive tokens (a prefill chunk)."""
        rows = np.array([self._row(key) for key in stream_keys], dtype=np.int64)
        out = np.empty((self.num_layers, len(rows), self.top_k), dtype=np.int16)
        if not len(rows):
            return out
        occurrence = _occurrence(rows.tolist())
        for nth in range(int(occurrence.max()) + 1):
            positions = np.flatnonzero(occurrence == nth)  # at most one token per stream
            out[:, positions] = self._advance(rows[positions])
        return out

    def release(self, stream_key: Hashable) -> None:
        """Forget a finished stream; its state row is reused by the next new stream."""
        row = self._rows.pop(stream_key, None)
        if row is not None:
            self._free_rows.append(row)

    def _row(self, key: Hashable) -> int:
        if key not in self._rows:
            row = self._free_rows.pop() if self._free_rows else self._num_rows
            self._num_rows = max(self._num_rows, row + 1)
            self._start_stream(row, self._num_created)
            self._num_created += 1
            self._rows[key] = row
        return self._rows[key]

    @abstractmethod
    def _start_stream(self, row: int, ordinal: int) -> None:
        """Fresh state in `row` for the `ordinal`-th stream ever started."""

    @abstractmethod
    def _advance(self, rows: np.ndarray) -> np.ndarray:
        """Next token of each (distinct) stream row: `[num_layers, len(rows), top_k]`."""


def _occurrence(rows: list[int]) -> np.ndarray:
    """How many earlier entries name the same row: `[len(rows)]`."""
    seen: Counter[int] = Counter()
    out = np.empty(len(rows), dtype=np.int64)
    for i, row in enumerate(rows):
        out[i] = seen[row]
        seen[row] += 1
    return out


def _layer_strength(model: LocalityModel, num_layers: int) -> np.ndarray:
    ramp = max(1, round(num_layers * model.ramp_fraction))
    rise = (1.0 - model.first_layer_strength) * np.arange(num_layers) / ramp
    return np.minimum(1.0, model.first_layer_strength + rise)  # [num_layers]


class SyntheticSource(RoutingSource):
    """Streams drawn from a `LocalityModel` (module docstring); popularity is shared by all streams."""

    def __init__(
        self, model: LocalityModel, num_layers: int, num_experts: int, top_k: int, seed: int = 0
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts], got {top_k} of {num_experts}")
        self.model, self.num_layers, self.num_experts, self.top_k = model, num_layers, num_experts, top_k
        self._rng = np.random.default_rng(seed)
        self._popularity = model.popularity_sigma * self._rng.standard_normal((num_layers, num_experts))
        self._score_std = math.sqrt(1.0 + model.popularity_sigma**2)
        self._strength = _layer_strength(model, num_layers)[:, None]  # [num_layers, 1]
        self._width = max(model.hot_width, top_k / num_experts)
        self._rho = math.exp(-1.0 / model.drift_tokens)
        ages = np.arange(_MAX_AGE + 1, dtype=np.float64)
        bonus = np.log1p(model.recency_boost * model.recency_decay ** np.maximum(ages - 1.0, 0.0))
        self._bonus = np.where(ages >= _MAX_AGE, 0.0, bonus)  # [age]; age _MAX_AGE = never used
        self._affinity = np.zeros((0, num_layers, num_experts), dtype=np.float32)  # [rows, layers, experts]
        self._age = np.zeros((0, num_layers, num_experts), dtype=np.int16)

    def _start_stream(self, row: int, ordinal: int) -> None:
        if row >= len(self._affinity):
            grow = max(row + 1, 2 * len(self._affinity)) - len(self._affinity)
            self._affinity = np.concatenate(
                [self._affinity, np.zeros((grow, *self._affinity.shape[1:]), np.float32)]
            )
            self._age = np.concatenate([self._age, np.zeros((grow, *self._age.shape[1:]), np.int16)])
        self._affinity[row] = self._rng.standard_normal(self._affinity.shape[1:])  # the request's hot set
        self._age[row] = _MAX_AGE

    def _log_weights(self, affinity: np.ndarray, age: np.ndarray) -> np.ndarray:
        score = (affinity + self._popularity) / self._score_std  # ~N(0, 1) per expert
        soft_rank = 1.0 / (1.0 + np.exp(_LOGISTIC_PROBIT * score))  # ~ share of experts scoring higher
        return self._strength * (self._bonus[age] - soft_rank / self._width)

    def _advance(self, rows: np.ndarray) -> np.ndarray:
        noise = self._rng.standard_normal((len(rows), self.num_layers, self.num_experts))
        affinity = self._rho * self._affinity[rows] + math.sqrt(1.0 - self._rho**2) * noise
        self._affinity[rows] = affinity
        age = self._age[rows]
        gumbel = -np.log(-np.log(self._rng.random(affinity.shape)))
        keys = self._log_weights(affinity, age) + gumbel  # [rows, layers, experts]
        top = np.argpartition(-keys, self.top_k - 1, axis=2)[..., : self.top_k]
        order = np.argsort(-np.take_along_axis(keys, top, axis=2), axis=2)
        ids = np.take_along_axis(top, order, axis=2)  # [rows, layers, top_k], the router's order
        age = np.minimum(age + 1, _MAX_AGE).astype(np.int16)
        np.put_along_axis(age, ids, 1, axis=2)
        self._age[rows] = age
        return ids.transpose(1, 0, 2)


def synthetic_trace(
    kind: str, num_layers: int, num_experts: int, top_k: int, num_tokens: int, seed: int = 0
) -> RoutingTrace:
    """One stream of `num_tokens` tokens from the `kind` family ("qwen3" | "mixtral")."""
    source = SyntheticSource(_locality_model(kind), num_layers, num_experts, top_k, seed)
    ids = np.empty((num_tokens, num_layers, top_k), dtype=np.int16)
    for t in range(num_tokens):
        ids[t] = source.next_step(1)[:, 0]
    return RoutingTrace(ids, num_experts, f"synthetic:{kind} seed={seed}")


def _locality_model(kind: str) -> LocalityModel:
    if kind not in LOCALITY_MODELS:
        raise ValueError(f"unknown synthetic routing {kind!r}; one of {', '.join(LOCALITY_MODELS)}")
    return LOCALITY_MODELS[kind]


class TraceSource(RoutingSource):
    """Streams that replay one trace from spread-out offsets, wrapping around at its end."""

    _SPREAD = (math.sqrt(5.0) - 1.0) / 2.0  # golden-ratio offsets stay apart for any stream count

    def __init__(self, trace: RoutingTrace) -> None:
        super().__init__()
        if trace.num_tokens == 0:
            raise ValueError("an empty trace cannot drive a benchmark")
        self.trace, self.num_layers, self.top_k = trace, trace.num_layers, trace.top_k
        self._positions: dict[int, int] = {}  # row -> next token

    def _start_stream(self, row: int, ordinal: int) -> None:
        self._positions[row] = int(ordinal * self._SPREAD * self.trace.num_tokens)

    def _advance(self, rows: np.ndarray) -> np.ndarray:
        tokens = [self._positions[r] % self.trace.num_tokens for r in rows.tolist()]
        for r in rows.tolist():
            self._positions[r] += 1
        return self.trace.expert_ids[tokens].transpose(1, 0, 2)  # [num_layers, rows, top_k]


def parse_routing(
    spec: str, num_layers: int, num_experts: int, top_k: int, seed: int = 0
) -> RoutingSource | None:
    """`model` (None: the real router) | `trace:FILE` | `synthetic:qwen3` | `synthetic:mixtral`."""
    kind, _, arg = spec.partition(":")
    if spec == "model":
        return None
    if kind == "synthetic" and arg:
        return SyntheticSource(_locality_model(arg), num_layers, num_experts, top_k, seed)
    if kind == "trace" and arg:
        trace = RoutingTrace.load(arg)
        shape = (trace.num_layers, trace.num_experts, trace.top_k)
        if shape != (num_layers, num_experts, top_k):
            raise ValueError(
                f"trace {arg} has (layers, experts, top_k) = {shape}; the model has "
                f"{(num_layers, num_experts, top_k)}"
            )
        return TraceSource(trace)
    raise ValueError(
        f"routing {spec!r}: expected model, trace:FILE or synthetic:<{'|'.join(LOCALITY_MODELS)}>"
    )


@dataclass(frozen=True, eq=False)
class RoutingLocality:
    """How sticky a trace's routing is, per layer (each figure a share in [0, 1])."""

    prev_overlap: np.ndarray  # [num_layers] share of a token's experts the previous token also used
    any_prev_overlap: np.ndarray  # [num_layers] share of tokens sharing >= 1 expert with the previous
    within_window: np.ndarray  # [num_layers] share of a token's experts used in the last `window` tokens
    top_expert_mass: np.ndarray  # [num_layers] the most used expert's share of the layer's picks
    median_reuse_distance: float  # tokens since the same layer last used the expert (never: inf)
    window: int


def _reuse_distances(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """`ids [T, L, k]` -> distances `[T - 1, L, k]` for tokens 1.., inf for a first use."""
    num_tokens, num_layers, _ = ids.shape
    last = np.full((num_layers, num_experts), -np.inf)
    out = np.empty((max(num_tokens - 1, 0), *ids.shape[1:]))
    for t in range(num_tokens):
        if t:
            out[t - 1] = t - np.take_along_axis(last, ids[t], axis=1)
        np.put_along_axis(last, ids[t], t, axis=1)
    return out


def routing_locality(trace: RoutingTrace, window: int = 8) -> RoutingLocality:
    ids = trace.expert_ids.astype(np.int64)
    if trace.num_tokens < 2:
        raise ValueError("locality needs at least two tokens")
    shared = (ids[1:, :, :, None] == ids[:-1, :, None, :]).any(axis=3)  # [T-1, L, k]
    dist = _reuse_distances(ids, trace.num_experts)
    counts = np.stack(
        [np.bincount(ids[:, layer].ravel(), minlength=trace.num_experts) for layer in range(trace.num_layers)]
    )
    return RoutingLocality(
        prev_overlap=shared.mean(axis=(0, 2)),
        any_prev_overlap=shared.any(axis=2).mean(axis=0),
        within_window=(dist <= window).mean(axis=(0, 2)),
        top_expert_mass=counts.max(axis=1) / (trace.num_tokens * trace.top_k),
        median_reuse_distance=float(np.median(dist)),
        window=window,
    )


class ReplayRouter:
    """The model's router replaced by routing drawn per request from a `RoutingSource` (benchmarks, trace
    replay): each step's expert ids are drawn on the host before its launch and copied to a device buffer
    the router reads (a captured graph reads it in place); the next token of each stream is drawn ahead
    while the device computes. The weights are the model's softmax at those ids."""

    def __init__(self, source: RoutingSource, num_moe_layers: int, max_tokens: int, model: TopKRouter,
                 device: torch.device) -> None:
        self.source, self.model, top_k = source, model, model.top_k
        # [tokens, layers, top_k]: a step's tokens are its first rows, one contiguous copy
        self.ids = torch.zeros((max_tokens, num_moe_layers, top_k), dtype=torch.int64, device=device)
        self.pinned = device.type == "cuda"
        self.staged = torch.zeros(self.ids.shape, dtype=torch.int64, pin_memory=True) if self.pinned else self.ids
        self._staged = self.staged.numpy()
        self.copied = torch.cuda.Event() if self.pinned else None
        self._keys: list[Hashable] = []  # the streams of the last step
        self._ahead: dict[Hashable, np.ndarray] = {}  # a stream's next token `[layers, top_k]`, drawn ahead

    def begin_step(self, token_keys: Sequence[Hashable]) -> None:
        n = len(token_keys)
        if n > self.ids.shape[0]:
            raise ValueError(f"{n} tokens in a step; the router holds {self.ids.shape[0]}")
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copy out of `staged` is done
        firsts = {key: i for i, key in reversed(list(enumerate(token_keys)))}
        ahead = {i for key, i in firsts.items() if key in self._ahead}
        fresh = [i for i in range(n) if i not in ahead]
        if fresh:
            self._staged[fresh] = self.source.route([token_keys[i] for i in fresh]).transpose(1, 0, 2)
        for i in ahead:
            self._staged[i] = self._ahead.pop(token_keys[i])
        if self.pinned:
            self.ids[:n].copy_(self.staged[:n], non_blocking=True)
            assert self.copied is not None
            self.copied.record()
        self._keys = list(firsts)

    def while_running(self) -> None:
        keys = [key for key in self._keys if key not in self._ahead]
        if keys:
            drawn = self.source.route(keys)
            for i, key in enumerate(keys):
                self._ahead[key] = drawn[:, i]

    def release(self, request_id: Hashable) -> None:
        self._ahead.pop(request_id, None)
        self.source.release(request_id)

    def __call__(self, moe_index: int, logits: torch.Tensor,
                 token_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # NOTE: a split model's later layers run on other devices than the one the ids are copied to
        ids = self.ids[:logits.shape[0], moe_index].to(logits.device, non_blocking=True)
        return self.model.weights_at(logits, ids, token_mask)


def make_router(spec: str, weights: ModelWeights, max_tokens: int, device: torch.device, seed: int = 0) -> Router:
    """The router a routing spec names: the model's own (`model`) or a replacement (`parse_routing`), for
    `LLMEngine.set_router`."""
    hp = weights.hparams
    source = parse_routing(spec, len(weights.moe_layers), hp.num_experts, hp.top_k, seed)
    if source is None:
        return TopKRouter.of(weights)
    return ReplayRouter(source, len(weights.moe_layers), max_tokens, TopKRouter.of(weights), device)
