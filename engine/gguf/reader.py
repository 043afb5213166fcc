"""GGUF files through the `gguf` package: metadata, tensor infos, split files, memory-mapped data.

Tensor bytes stay in the file's memory map: a tensor's `data` is a numpy view, never a copy.
"""

from __future__ import annotations

import mmap
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

_SPLIT_RE = re.compile(r"^(?P<prefix>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(ValueError):
    """A GGUF file that cannot be used; the message names the file and, where known, the tensor."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order: outermost first, e.g. [rows, cols] for a matrix
    data: np.ndarray  # uint8 [..., row_bytes] for block formats, typed for F32/F16; a view of the map
    path: Path

    @property
    def num_bytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def num_cols(self) -> int:
        return self.shape[-1]

    def raw(self) -> np.ndarray:
        """The tensor's bytes as uint8 `[*shape[:-1], row_bytes]` (still a view of the map)."""
        rows = self.shape[:-1]
        return self.data.view(np.uint8).reshape(*rows, -1)


def split_paths(path: Path) -> list[Path]:
    """All files of a split model, given any one of them (or a single-file model)."""
    match = _SPLIT_RE.match(path.name)
    if not match:
        return [path]
    count = int(match["count"])
    paths = [path.with_name(f"{match['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise GGUFError(f"{path}: split model is missing {', '.join(missing)}")
    return paths


def _field_value(field: Any) -> Any:
    types = field.types
    if types[0] == GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [v.item() for i in field.data for v in field.parts[i]]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]][0].item()


class _CheckedReader(GGUFReader):
    """GGUFReader that names the tensor when a file is too short for it."""

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            qtype = GGMLQuantizationType(int(raw_type[0]))
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            end = int(start_offs + offset[0]) + int(np.prod(dims)) * type_size // block_size
            if end > len(self.data):
                shape = [int(d) for d in reversed(dims.tolist())]
                raise _Truncated(f"tensor '{bytes(name).decode()}' ({qtype.name}, shape {shape}) needs "
                                 f"bytes up to {end} but the file has {len(self.data)}: truncated file")
        super()._build_tensors(start_offs, fields)


class _Truncated(Exception):
    pass


def _open_reader(path: Path) -> GGUFReader:
    if not path.exists():
        raise GGUFError(f"{path}: no such file")
    try:
        return _CheckedReader(path)
    except _Truncated as exc:
        raise GGUFError(f"{path}: {exc}") from None
    except (ValueError, IndexError, OSError, KeyError, UnicodeDecodeError) as exc:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (magic {magic!r})") from exc
        raise GGUFError(f"{path}: corrupt or truncated GGUF header: {exc}") from exc


def _tensor_info(reader: GGUFReader, tensor: Any, path: Path) -> TensorInfo:
    qtype = GGMLQuantizationType(int(tensor.tensor_type))
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return TensorInfo(tensor.name, qtype, shape, tensor.data, path)


def _squeeze(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape without leading 1s: ggml treats [n] and [1, n] alike."""
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


class GGUFFile:
    """One model, possibly split over several files. Metadata comes from the first file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.paths = split_paths(self.path)
        self._readers = [_open_reader(p) for p in self.paths]
        self.metadata: dict[str, Any] = self._read_metadata(self._readers[0])
        self.tensors: dict[str, TensorInfo] = {}
        for reader, p in zip(self._readers, self.paths):
            for tensor in reader.tensors:
                self.tensors[tensor.name] = _tensor_info(reader, tensor, p)

    @staticmethod
    def _read_metadata(reader: GGUFReader) -> dict[str, Any]:
        return {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: metadata has no general.architecture")
        return arch

    @property
    def file_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.paths)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata key '{key}' is missing")
        return self.metadata[key]

    def tensor(self, name: str, shape: tuple[int, ...] | None = None) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path}: tensor '{name}' is missing")
        if shape is not None and _squeeze(info.shape) != _squeeze(tuple(shape)):
            raise GGUFError(f"{info.path}: tensor '{name}' has shape {list(info.shape)}, expected {list(shape)}")
        return info

    def release_pages(self, address: int, length: int) -> None:
        """Drop this process's mapping of a byte range of the map (the page cache keeps the file), so
        bytes copied elsewhere are not counted twice in RSS. Ranges outside the maps are ignored."""
        for reader in self._readers:
            start = address - reader.data.ctypes.data
            if 0 <= start < len(reader.data) and hasattr(mmap, "MADV_DONTNEED"):
                aligned = start // mmap.PAGESIZE * mmap.PAGESIZE
                # numpy keeps the map of a memmap in its private `_mmap`
                reader.data._mmap.madvise(mmap.MADV_DONTNEED, aligned, start - aligned + length)  # type: ignore[attr-defined]

    def locate(self, address: int) -> tuple[Path, int]:
        """The file and byte offset of an address in the maps (each file is mapped whole, from offset 0), so a
        range of a tensor can be read with `os.pread` instead of through the map."""
        for reader, path in zip(self._readers, self.paths):
            start = address - reader.data.ctypes.data
            if 0 <= start < len(reader.data):
                return path, start
        raise ValueError(f"address {address:#x} is not in the maps of {self.path}")

    def has(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())
