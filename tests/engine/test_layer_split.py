"""Several devices: the layers' contiguous ranges, the budget's split, and the flags that ask for them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.config import ModelConfig
from engine.layer_split import FITS_ONE, LayerSplit, split_budget, split_layers, spread_devices

shares = st.lists(st.floats(0.05, 20.0), min_size=1, max_size=8)


@given(num_layers=st.integers(1, 96), shares=shares)
def test_every_layer_is_placed_once_in_contiguous_ranges(num_layers: int, shares: list[float]) -> None:
    if len(shares) > num_layers:
        with pytest.raises(ValueError, match="each needs a layer"):
            split_layers(num_layers, shares)
        return
    split = LayerSplit(("cpu",) * len(shares), split_layers(num_layers, shares), num_layers)
    placed = [layer for r in split.ranges for layer in r]
    assert placed == list(range(num_layers))  # in order: contiguous, each once
    assert all(len(r) >= 1 for r in split.ranges)
    assert all(split.index_of(layer) == i for i, r in enumerate(split.ranges) for layer in r)


@given(num_layers=st.integers(16, 96), shares=st.lists(st.floats(1.0, 4.0), min_size=2, max_size=4))
def test_the_ranges_follow_the_shares(num_layers: int, shares: list[float]) -> None:
    # every ideal range is over a layer here, so no range is widened to hold one
    split = LayerSplit(("cpu",) * len(shares), split_layers(num_layers, shares), num_layers)
    for r, share in zip(split.ranges, shares, strict=True):
        # each boundary rounded once: a range is off its ideal size by at most a layer
        assert abs(len(r) - num_layers * share / sum(shares)) <= 1


@pytest.mark.parametrize(("num_layers", "shares", "starts"), [
    (48, [1, 1], (0, 24)), (48, [3, 1], (0, 36)), (48, [1, 2, 1], (0, 12, 36)), (4, [100, 1, 1], (0, 2, 3)),
    (2, [1, 1], (0, 1)), (5, [1], (0,))])
def test_tensor_split_proportions(num_layers: int, shares: list[float], starts: tuple[int, ...]) -> None:
    assert split_layers(num_layers, shares) == starts


@given(budget=st.integers(0, 1 << 40), host=st.lists(st.integers(0, 1 << 36), min_size=1, max_size=8))
def test_the_budget_split_adds_up_in_proportion_to_host_expert_bytes(budget: int, host: list[int]) -> None:
    parts = split_budget(budget, host)
    if not sum(host):
        assert parts == [0] * len(host)  # nothing to cache
        return
    assert sum(parts) == budget
    for part, h in zip(parts, host, strict=True):
        assert abs(part - budget * h / sum(host)) < 1 + 1e-6 * budget  # largest remainders: within a byte
        assert h or not part  # no host experts, no budget


@pytest.mark.parametrize(("starts", "num_layers"), [((1, 3), 4), ((0, 0), 4), ((0, 4), 4), ((0, 3, 2), 4)])
def test_a_split_that_skips_or_repeats_layers_is_refused(starts: tuple[int, ...], num_layers: int) -> None:
    with pytest.raises(ValueError):
        LayerSplit(("cpu",) * len(starts), starts, num_layers)


def test_a_model_that_does_not_fit_the_first_gpu_spreads_over_every_visible_one() -> None:
    gib = 1 << 30
    assert spread_devices(17 * gib, [24 * gib, 24 * gib]) == ("cuda:0",)  # fits the first: one GPU, no hand-off
    assert spread_devices(int(FITS_ONE * 24 * gib) + 1, [24 * gib, 24 * gib]) == ("cuda:0", "cuda:1")
    assert spread_devices(60 * gib, [24 * gib, 12 * gib, 12 * gib]) == ("cuda:0", "cuda:1", "cuda:2")
    assert spread_devices(60 * gib, [24 * gib]) == ("cuda:0",)  # one GPU: its expert cache takes the rest
    with pytest.raises(ValueError, match="no GPU"):
        spread_devices(gib, [])


def test_a_device_named_twice_gets_distinct_labels() -> None:
    split = LayerSplit(("cpu", "cpu"), (0, 2), 4)
    assert split.labels == ("cpu#0", "cpu#1") and split.device_of(1) == "cpu" and split.index_of(2) == 1
    assert LayerSplit(("cuda:0", "cuda:1"), (0, 2), 4).labels == ("cuda:0", "cuda:1")


def test_devices_and_tensor_split_flags() -> None:
    config = ModelConfig(devices="cuda:0, cuda:1", tensor_split="3,1")
    assert config.device_names == ("cuda:0", "cuda:1") and config.split_shares == (3.0, 1.0)
    assert ModelConfig().device_names == ("auto",) and ModelConfig().split_shares is None
    assert ModelConfig(devices="cpu,cpu").device_names == ("cpu", "cpu")  # the CPU twice: the split's code path
    assert ModelConfig(devices="cuda:0,cuda:0").device_names == ("cuda:0", "cuda:0")  # on one GPU


@pytest.mark.parametrize(("fields", "message"), [
    ({"devices": "gpu0,gpu1"}, "--devices takes a comma-separated list of cpu or cuda:N"),
    ({"devices": "cuda:0,"}, "--devices takes a comma-separated list"),
    ({"devices": "cuda:0,cpu"}, "--devices are all cuda or all cpu"),
    ({"device": "cuda:0", "devices": "cuda:0,cuda:1"}, "give --device or --devices, not both"),
    ({"tensor_split": "1,1"}, "--tensor-split .* give --devices"),
    ({"devices": "cuda:0,cuda:1", "tensor_split": "1,1,1"}, "--tensor-split has 3 shares for 2 devices"),
    ({"devices": "cuda:0,cuda:1", "tensor_split": "1,0"}, "--tensor-split shares must be positive"),
    ({"devices": "cuda:0,cuda:1", "tensor_split": "1,-2"}, "--tensor-split shares must be positive"),
    ({"devices": "cuda:0,cuda:1", "tensor_split": "1,inf"}, "--tensor-split shares must be positive"),
    ({"devices": "cuda:0,cuda:1", "tensor_split": "a,b"}, "--tensor-split takes comma-separated numbers"),
])
def test_bad_devices_or_tensor_split_name_the_flag(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)
