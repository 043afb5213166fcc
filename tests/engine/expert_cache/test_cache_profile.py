"""Expert-use profiles: counting, merging, ranking, and the file format."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from engine.expert_cache.profile import PROFILE_FORMAT, Profile, ProfileError


def test_add_counts_every_entry() -> None:
    profile = Profile()
    profile.add(3, [1, 2, 2])
    profile.add(3, np.array([2, 5], dtype=np.int16))
    assert profile.layer_counts(3) == {1: 1, 2: 3, 5: 1}
    assert profile.count(3, 2) == 3 and profile.count(4, 0) == 0
    assert profile.layers == (3,)


def test_add_rejects_negative_ids() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        Profile().add(0, [-1])


def test_merge_adds_counts_and_leaves_inputs_alone() -> None:
    a = Profile({0: {1: 2}})
    b = Profile({0: {1: 3, 2: 1}, 4: {0: 7}})
    merged = a.merge(b)
    assert merged.as_dict() == {0: {1: 5, 2: 1}, 4: {0: 7}}
    assert a.as_dict() == {0: {1: 2}}


def test_top_ranks_a_layer_or_a_group_of_layers() -> None:
    profile = Profile({0: {1: 5, 2: 9, 3: 0}, 1: {4: 7, 5: 5}})
    assert profile.top(0) == [(0, 2), (0, 1)]  # unused experts are never ranked
    assert profile.top([0, 1], 3) == [(0, 2), (1, 4), (0, 1)]
    assert profile.top((1, 0), 4) == [(0, 2), (1, 4), (0, 1), (1, 5)]  # ties by (layer, expert)


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    profile = Profile({0: {1: 5}, 47: {127: 3}})
    path = tmp_path / "profile.json"
    profile.save(path)
    doc = json.loads(path.read_text())
    assert doc["format"] == PROFILE_FORMAT and doc["version"] == 1
    assert Profile.load(path) == profile


def doc(version: object = 1, **layers: object) -> str:
    return json.dumps({"format": PROFILE_FORMAT, "version": version, **layers})


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not JSON"),
        ('{"format": "other", "version": 1, "layers": {}}', "not a moecache-expert-profile"),
        (doc(9, layers={}), "version 9, expected 1"),
        (doc(layers={"a": {}}), "bad layers table"),
        (doc(layers={"0": {"1": 2.5}}), "bad layers table"),
        (doc(layers={"0": {"1": -3}}), "bad layers table"),
        (doc(), "bad layers table"),
    ],
)
def test_bad_files_give_clear_errors(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ProfileError, match=message):
        Profile.load(path)


def test_missing_file_is_a_profile_error(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="no such file"):
        Profile.load(tmp_path / "absent.json")
