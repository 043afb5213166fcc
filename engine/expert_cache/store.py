"""Every routed expert's bytes, held once: in host RAM (pinned on CUDA, the GGUF map on a CPU device)
and, for layers placed resident, on the device; or left in the GGUF file, read through a host-RAM tier
(`ram_tier.py`, `--ssd-moe`). Successive caches (a benchmark sweep) share it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from engine.expert_cache.device import bank_to
from engine.expert_cache.host import pin_experts
from engine.expert_cache.ram_tier import RamTier
from engine.expert_cache.stats import CacheStats
from engine.weights import ModelWeights, MoE
from ops.bank import ExpertWeights, to_planar


class ExpertStore:
    def __init__(self, weights: ModelWeights, device: torch.device,
                 release: Callable[[int, int], None] | None = None,
                 locate: Callable[[int], tuple[Path, int]] | None = None) -> None:
        """release(address, length): drop the map's pages of a range; locate(address): its file and offset."""
        self.device = device
        self.hparams = weights.hparams
        self.mapped = {i: ffn.experts for i in weights.moe_layers  # views of the map
                       if isinstance(ffn := weights.layers[i].ffn, MoE)}
        # NOTE: a layer's resident experts go to its router's device (a split model's layers are on several)
        self.layer_device = {i: ffn.router.device for i in weights.moe_layers
                             if isinstance(ffn := weights.layers[i].ffn, MoE)}
        self.release = release or (lambda address, length: None)
        self.locate = locate
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

    def disk_tier(self, layers: Sequence[int], budget_bytes: int, min_slots: int, stats: CacheStats) -> RamTier:
        """A host-RAM tier reading the layers' experts from the GGUF file. NOTE: their map views give shapes,
        types and file offsets only; nothing here copies, pins or reads a disk layer's bytes."""
        if self.locate is None:
            raise ValueError("experts on disk need the GGUF file's offsets: build the store with `locate`")
        return RamTier({i: self.mapped[i] for i in layers}, self.locate, budget_bytes, min_slots, stats,
                       pin=self.device.type == "cuda")

    def resident(self, layer: int) -> ExpertWeights:
        """The layer's experts on the device (the map itself when the device is the CPU); on CUDA its MXFP4
        matrices planar (`ops.bank.to_planar`: the decode kernels read a block's codes in one vector)."""
        if layer not in self._resident:
            device = self.layer_device[layer]
            bank = bank_to(self._host.get(layer, self.mapped[layer]), device)
            self._resident[layer] = to_planar(bank) if device.type == "cuda" else bank
        return self._resident[layer]

    def keep_resident(self, layers: set[int]) -> None:
        """Free the device copies of layers no longer placed resident."""
        for layer in [x for x in self._resident if x not in layers]:
            del self._resident[layer]
