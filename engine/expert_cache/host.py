"""Routed experts in host RAM, one copy each.

With a CUDA device the experts the GPU uploads or reads live in pinned memory: their bytes are copied
out of the GGUF memory map (the map itself is never registered) and the map's pages are dropped as
each tensor is copied, so RAM never holds an expert twice. With a CPU device the map is used as is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ops.bank import ExpertWeights


def pin_experts(layers: dict[int, ExpertWeights], release: Callable[[int, int], None],
                progress: Callable[[int], None] | None = None) -> dict[int, ExpertWeights]:
    """Pinned host copies of the given layers' experts (CUDA only). `release(address, length)` drops
    the map's pages of a tensor once it is copied."""

    def pinned_copy(src: torch.Tensor) -> torch.Tensor:
        dst = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
        dst.copy_(src)
        # NOTE: the bytes the tensor spans: a view of merged gate/up experts spans its twin's too
        release(src.data_ptr(), (src.shape[0] - 1) * src.stride(0) + src[0].numel())
        return dst

    pinned = {}
    for layer, w in layers.items():
        gate, up, down = (pinned_copy(t) for t in (w.gate, w.up, w.down))
        pinned[layer] = replace(w, gate=gate, up=up, down=down)
        if progress:
            progress(sum(t.numel() for t in (gate, up, down)))
    return pinned
