"""One module per architecture; each exports `ARCH`, an `ArchSpec`."""

from __future__ import annotations

from engine.arch import deepseek2, gemma4, gptoss, llama, olmoe, qwen2moe, qwen3moe
from engine.arch.base import ArchSpec, HParams

ARCHITECTURES: dict[str, ArchSpec] = {m.ARCH.name: m.ARCH for m in (qwen3moe, qwen2moe, llama, olmoe, deepseek2,
                                                                        gptoss, gemma4)}


def get_arch(name: str) -> ArchSpec:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        known = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(f"unsupported architecture '{name}' (supported: {known})") from None


__all__ = ["ARCHITECTURES", "ArchSpec", "HParams", "get_arch"]
