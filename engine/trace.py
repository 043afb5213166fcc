"""Routing traces: which experts the routers selected, token by token, as the engine records them.

A trace holds the tokens of one stream in order: `expert_ids [num_tokens, num_layers, top_k]`. The engine
records one stream per request (`RequestTraces`, `moecache serve --record-trace`); `moecache plan --trace`
replays a trace through the cache policies (`engine.expert_cache.replay`) and the benchmarks replay it as
routing (`tools.routing`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

TRACE_FORMAT_VERSION = 1

PathLike = str | os.PathLike[str]


class TraceError(ValueError):
    """A routing trace file that cannot be used, with the reason."""


def _check_ids(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    if expert_ids.ndim != 3:
        raise ValueError(f"expert_ids must be [num_tokens, num_layers, top_k], got shape {expert_ids.shape}")
    if not np.issubdtype(expert_ids.dtype, np.integer):
        raise ValueError(f"expert_ids must be integers, got {expert_ids.dtype}")
    if not 1 <= num_experts <= np.iinfo(np.int16).max:
        raise ValueError(f"num_experts must be in [1, 32767], got {num_experts}")
    if expert_ids.size and (expert_ids.min() < 0 or expert_ids.max() >= num_experts):
        raise ValueError(f"expert ids must lie in [0, {num_experts})")
    ordered = np.sort(expert_ids, axis=2)
    if (ordered[..., 1:] == ordered[..., :-1]).any():
        raise ValueError("a token selects distinct experts at each layer")
    ids = np.array(expert_ids, dtype=np.int16)
    ids.flags.writeable = False
    return ids


@dataclass(frozen=True, eq=False)
class RoutingTrace:
    """The experts one stream of tokens selected, in token order."""

    expert_ids: np.ndarray  # [num_tokens, num_layers, top_k] int16
    num_experts: int
    source: str
    # model layer index of each trace layer; empty: 0..num_layers-1 (models with dense layers differ)
    layers: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "expert_ids", _check_ids(np.asarray(self.expert_ids), self.num_experts))
        layers = tuple(self.layers) or tuple(range(self.expert_ids.shape[1]))
        if len(layers) != self.expert_ids.shape[1] or len(set(layers)) != len(layers):
            raise ValueError(f"layers {layers} do not name the {self.expert_ids.shape[1]} trace layers")
        object.__setattr__(self, "layers", layers)

    @property
    def num_tokens(self) -> int:
        return int(self.expert_ids.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.expert_ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.expert_ids.shape[2])

    def save(self, path: PathLike) -> None:
        """Write a compressed .npz (exactly at `path`)."""
        with open(path, "wb") as f:
            np.savez_compressed(
                f,
                format_version=np.int64(TRACE_FORMAT_VERSION),
                expert_ids=self.expert_ids,
                num_experts=np.int64(self.num_experts),
                layers=np.asarray(self.layers, dtype=np.int64),
                source=np.str_(self.source),
            )

    @classmethod
    def load(cls, path: PathLike) -> RoutingTrace:
        fields = _read_npz(path)
        version = int(fields["format_version"])
        if version != TRACE_FORMAT_VERSION:
            raise TraceError(
                f"routing trace {path}: format version {version}, expected {TRACE_FORMAT_VERSION}"
            )
        try:
            return cls(
                expert_ids=fields["expert_ids"],
                num_experts=int(fields["num_experts"]),
                source=str(fields["source"]),
                layers=tuple(int(x) for x in fields["layers"]),
            )
        except ValueError as e:
            raise TraceError(f"routing trace {path}: {e}") from e


def _read_npz(path: PathLike) -> dict[str, np.ndarray]:
    keys = ("format_version", "expert_ids", "num_experts", "layers", "source")
    try:
        npz = np.load(path, allow_pickle=False)
    except FileNotFoundError as e:
        raise TraceError(f"routing trace {path}: no such file") from e
    except (OSError, ValueError) as e:
        raise TraceError(f"routing trace {path}: not a .npz routing trace ({e})") from e
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise TraceError(f"routing trace {path}: not a .npz routing trace (a single array)")
    with npz:
        missing = [k for k in keys if k not in npz.files]
        if missing:
            raise TraceError(f"routing trace {path}: missing {', '.join(missing)}")
        try:
            return {k: npz[k] for k in keys}
        except Exception as e:  # a damaged archive fails here, with zipfile's or numpy's error
            raise TraceError(f"routing trace {path}: unreadable ({e})") from e


class TraceRecorder:
    """Accumulates what a running engine routed, step by step, in token order.

    A trace is one stream: record the rows of one sequence (or a single-sequence run). Without
    `num_experts` the trace assumes the largest id seen + 1.
    """

    def __init__(
        self, num_experts: int | None = None, source: str = "recorded", layers: tuple[int, ...] = ()
    ) -> None:
        self.num_experts = num_experts
        self.source = source
        self.layers = layers
        self._steps: list[np.ndarray] = []  # each [num_tokens, num_layers, top_k]

    @property
    def num_tokens(self) -> int:
        return sum(s.shape[0] for s in self._steps)

    def add_step(self, step_ids: np.ndarray) -> None:
        """`step_ids [num_layers, num_tokens, top_k]`, the tokens of one step in stream order."""
        ids = np.asarray(step_ids)
        if ids.ndim != 3:
            raise ValueError(f"step ids must be [num_layers, num_tokens, top_k], got shape {ids.shape}")
        if self._steps and (ids.shape[0], ids.shape[2]) != self._steps[0].shape[1:]:
            raise ValueError(f"step of shape {ids.shape} does not match the earlier steps")
        self._steps.append(np.array(ids.transpose(1, 0, 2), dtype=np.int16))

    def trace(self) -> RoutingTrace:
        if not self._steps:
            raise ValueError("no steps recorded")
        ids = np.concatenate(self._steps)
        num_experts = self.num_experts if self.num_experts is not None else int(ids.max()) + 1
        return RoutingTrace(ids, num_experts, self.source, self.layers)

    def save(self, path: PathLike) -> None:
        self.trace().save(path)


class RequestTraces:
    """Each request's routing as its own stream (a trace is the tokens of one sequence), saved one request
    after another as one trace."""

    def __init__(self, num_experts: int, layers: tuple[int, ...], top_k: int) -> None:
        self.num_experts, self.layers, self.top_k = num_experts, layers, top_k
        self.streams: dict[str, list[np.ndarray]] = {}  # request id -> its steps' `[tokens, num_layers, top_k]`

    def add_step(self, seqs: Sequence[tuple[str, int]], ids: np.ndarray) -> None:
        """One step's expert ids `[num_layers, pairs]`, whose tokens are those of `seqs` (request id, number
        of tokens) in order, top_k pairs each."""
        k, row = self.top_k, 0
        for request_id, n in seqs:
            tokens = ids[:, row * k:(row + n) * k].reshape(ids.shape[0], n, k).transpose(1, 0, 2)
            self.streams.setdefault(request_id, []).append(tokens)
            row += n

    def save(self, path: PathLike) -> None:
        recorder = TraceRecorder(self.num_experts, "recorded", self.layers)
        for chunks in self.streams.values():
            recorder.add_step(np.concatenate(chunks).transpose(1, 0, 2))
        recorder.save(path)
