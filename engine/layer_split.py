"""Several devices in one box: the model's layers in contiguous ranges, one a device (a pipeline: within a step the
activations go from one device to the next at the ranges' boundaries), and the expert-cache budget split across the
devices in proportion to the host-RAM expert bytes of their layers. Torch-free."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerSplit:
    """Each device's contiguous range of layers: device i holds layers starts[i] .. starts[i + 1] - 1 (the last one
    to the end), their weights, KV cache and expert cache; the embedding is on the first, the final norm and the
    output on the last. A device may be named twice (the CPU: the split's code path on one machine)."""

    devices: tuple[str, ...]
    starts: tuple[int, ...]  # first layer of each device's range
    num_layers: int

    def __post_init__(self) -> None:
        if not self.devices or len(self.starts) != len(self.devices):
            raise ValueError(f"one range start per device: {self.starts} for {self.devices}")
        # NOTE: every layer is placed once: the ranges start at 0, are not empty and end at the last layer
        if self.starts[0] != 0 or any(b <= a for a, b in itertools.pairwise(self.starts)) or \
                self.starts[-1] >= self.num_layers:
            raise ValueError(f"layer ranges starting at {self.starts} do not split {self.num_layers} layers")

    @property
    def ranges(self) -> tuple[range, ...]:
        return tuple(range(a, b) for a, b in zip(self.starts, (*self.starts[1:], self.num_layers), strict=True))

    def index_of(self, layer: int) -> int:
        """The device (its index) that holds the layer."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} of a model of {self.num_layers} layers")
        return bisect.bisect_right(self.starts, layer) - 1

    def device_of(self, layer: int) -> str:
        return self.devices[self.index_of(layer)]

    @property
    def labels(self) -> tuple[str, ...]:
        """A distinct name for each device (reports, metrics): its own, with its index where it is named twice."""
        return tuple(d if self.devices.count(d) == 1 else f"{d}#{i}" for i, d in enumerate(self.devices))

    def describe(self) -> str:
        return ", ".join(f"{label} layers {r.start}-{r.stop - 1}" for label, r in zip(self.labels, self.ranges,
                                                                                    strict=True))


def split_layers(num_layers: int, shares: Sequence[float]) -> tuple[int, ...]:
    """The first layer of each of `len(shares)` contiguous ranges of `num_layers` layers, sized in proportion to the
    shares (each range at least one layer)."""
    if len(shares) > num_layers:
        raise ValueError(f"{len(shares)} devices for a model of {num_layers} layers: each needs a layer")
    if not shares or not all(s > 0 for s in shares):
        raise ValueError(f"the shares of the layers must be positive (got {list(shares)})")
    total, starts = sum(shares), [0]
    for i, before in enumerate(itertools.accumulate(shares[:-1]), start=1):
        ideal = round(num_layers * before / total)
        starts.append(min(max(ideal, starts[-1] + 1), num_layers - (len(shares) - i)))
    return tuple(starts)


# the share of a GPU's free memory a model's bytes may take and still run on that GPU alone (KV cache, activations
# and the expert cache's headroom need the rest)
FITS_ONE = 0.9


def spread_devices(model_bytes: int, free_bytes: Sequence[int]) -> tuple[str, ...]:
    """The GPUs a model runs on where none is named (free_bytes: each visible GPU's free memory): the first alone
    where the model fits it, else every one, its layers split across them (each GPU caching its layers' experts)."""
    if not free_bytes:
        raise ValueError("no GPU to run on")
    if len(free_bytes) == 1 or model_bytes <= FITS_ONE * free_bytes[0]:
        return ("cuda:0",)
    return tuple(f"cuda:{i}" for i in range(len(free_bytes)))


def split_budget(budget_bytes: int, host_bytes: Sequence[int]) -> list[int]:
    """A byte budget split across devices in proportion to their host-RAM expert bytes (largest remainders: the
    parts add up to the budget); a device with no such bytes gets none (none at all: nothing to cache, no budget)."""
    total = sum(host_bytes)
    if total == 0:
        return [0] * len(host_bytes)
    parts = [budget_bytes * b // total for b in host_bytes]
    order = sorted(range(len(host_bytes)), key=lambda i: -(budget_bytes * host_bytes[i] % total))
    for i in order[:budget_bytes - sum(parts)]:
        parts[i] += 1
    return parts
