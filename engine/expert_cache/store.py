"""Every routed expert's bytes, held once: in host RAM (pinned on CUDA, the GGUF map on a CPU device)
and, for layers placed resident, on the device. Successive caches (a benchmark sweep) share it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.expert_cache.device import bank_to
from engine.expert_cache.host import pin_experts
from engine.weights import ModelWeights, MoE
from ops.bank import ExpertWeights


class ExpertStore:
    def __init__(self, weights: ModelWeights, device: torch.device,
                 release: Callable[[int, int], None] | None = None) -> None:
        self.device = device
        self.hparams = weights.hparams
        self.mapped = {i: ffn.experts for i in weights.moe_layers  # views of the map
                       if isinstance(ffn := weights.layers[i].ffn, MoE)}
        self.release = release or (lambda address, length: None)
        self._host: dict[int, ExpertWeights] = {}
        self._resident: dict[int, ExpertWeights] = {}

    @property
    def layers(self) -> list[int]:
        return sorted(self.mapped)

    def expert_bytes(self, layer: int) -> int:
        return self.mapped[layer].expert_bytes

    def layer_bytes(self) -> dict[int, int]:
        return {i: self.expert_bytes(i) * self.hparams.num_experts for i in self.mapped}

    def host(self, layer: int) -> ExpertWeights:
        """The layer's experts where the device can upload or read them: pinned memory on CUDA."""
        if layer not in self._host:
            if self.device.type == "cuda":
                self._host.update(pin_experts({layer: self.mapped[layer]}, self.release))
            else:
                self._host[layer] = self.mapped[layer]
        return self._host[layer]

    def resident(self, layer: int) -> ExpertWeights:
        """The layer's experts on the device (the map itself when the device is the CPU)."""
        if layer not in self._resident:
            self._resident[layer] = bank_to(self._host.get(layer, self.mapped[layer]), self.device)
        return self._resident[layer]

    def keep_resident(self, layers: set[int]) -> None:
        """Free the device copies of layers no longer placed resident."""
        for layer in [x for x in self._resident if x not in layers]:
            del self._resident[layer]
