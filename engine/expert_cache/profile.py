"""A profile of expert use: layer -> expert -> how many (token, k) picks selected it.

Saved at shutdown and loaded at startup to warm-start a cache policy (`--cache-profile`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping

PROFILE_FORMAT = "moecache-expert-profile"
PROFILE_VERSION = 1

PathLike = str | os.PathLike[str]


class ProfileError(ValueError):
    """A profile file that cannot be used, with the reason."""


class Profile:
    def __init__(self, counts: Mapping[int, Mapping[int, int]] | None = None) -> None:
        self._counts: dict[int, Counter[int]] = {}
        for layer, experts in (counts or {}).items():
            for expert, n in experts.items():
                self._add_count(int(layer), int(expert), int(n))

    def _add_count(self, layer: int, expert: int, n: int) -> None:
        if layer < 0 or expert < 0 or n < 0:
            raise ValueError(f"profile entry layer {layer}, expert {expert}, count {n} must be >= 0")
        self._counts.setdefault(layer, Counter())[expert] += n

    def add(self, layer: int, expert_ids: Iterable[int]) -> None:
        """Counts one use per entry of `expert_ids` (repeats allowed)."""
        ids = [int(e) for e in expert_ids]
        if any(e < 0 for e in ids):
            raise ValueError(f"expert ids must be >= 0, got {ids}")
        self._counts.setdefault(layer, Counter()).update(ids)

    def merge(self, other: Profile) -> Profile:
        """A new profile with the counts of both."""
        merged = Profile(self.as_dict())
        for layer, experts in other.as_dict().items():
            for expert, n in experts.items():
                merged._add_count(layer, expert, n)
        return merged

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self._counts))

    def count(self, layer: int, expert: int) -> int:
        return self._counts.get(layer, Counter())[expert]

    def layer_counts(self, layer: int) -> dict[int, int]:
        return dict(self._counts.get(layer, {}))

    def top(self, layers: int | Iterable[int], n: int | None = None) -> list[tuple[int, int]]:
        """The `n` most used (layer, expert) of one layer or a group of layers; ties by (layer, expert)."""
        wanted = (layers,) if isinstance(layers, int) else tuple(layers)
        used = [((lyr, e), c) for lyr in wanted for e, c in self._counts.get(lyr, {}).items() if c > 0]
        used.sort(key=lambda item: (-item[1], item[0]))
        return [expert for expert, _ in used[:n]]

    def as_dict(self) -> dict[int, dict[int, int]]:
        return {layer: dict(experts) for layer, experts in self._counts.items()}

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Profile):
            return NotImplemented
        return _nonzero(self) == _nonzero(other)

    def save(self, path: PathLike) -> None:
        layers = {
            str(lyr): {str(e): n for e, n in sorted(c.items())} for lyr, c in sorted(self._counts.items())
        }
        doc = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "layers": layers}
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f)

    @classmethod
    def load(cls, path: PathLike) -> Profile:
        doc = _read_json(path)
        if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
            raise ProfileError(f"expert profile {path}: not a {PROFILE_FORMAT} file")
        if doc.get("version") != PROFILE_VERSION:
            raise ProfileError(
                f"expert profile {path}: version {doc.get('version')}, expected {PROFILE_VERSION}"
            )
        try:
            return cls(
                {int(lyr): {int(e): _count(n) for e, n in c.items()} for lyr, c in doc["layers"].items()}
            )
        except (KeyError, AttributeError, TypeError, ValueError) as e:
            raise ProfileError(f"expert profile {path}: bad layers table ({e})") from e


def _count(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"count {value!r} is not an integer")
    return value


def _nonzero(profile: Profile) -> dict[int, dict[int, int]]:
    table = {lyr: {e: n for e, n in c.items() if n} for lyr, c in profile.as_dict().items()}
    return {lyr: c for lyr, c in table.items() if c}


def _read_json(path: PathLike) -> object:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError as e:
        raise ProfileError(f"expert profile {path}: no such file") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ProfileError(f"expert profile {path}: not JSON ({e})") from e
