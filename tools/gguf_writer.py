"""Write GGUF files (tests, `moecache synth`, the embedded model) with the `gguf` package.

Tensors are produced one at a time while the file is written, so a 17 GB model never sits in RAM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter, LlamaFileType

from ops.quants import QType, quantize

FILE_TYPE_KEY = "general.file_type"
# llama.cpp's file type named after a tensor type (its loader's guess for a file without the key)
FILE_TYPES = {
    QType.F32: LlamaFileType.ALL_F32, QType.F16: LlamaFileType.MOSTLY_F16, QType.BF16: LlamaFileType.MOSTLY_BF16,
    QType.Q4_0: LlamaFileType.MOSTLY_Q4_0, QType.Q4_1: LlamaFileType.MOSTLY_Q4_1,
    QType.Q5_0: LlamaFileType.MOSTLY_Q5_0, QType.Q5_1: LlamaFileType.MOSTLY_Q5_1,
    QType.Q8_0: LlamaFileType.MOSTLY_Q8_0, QType.Q2_K: LlamaFileType.MOSTLY_Q2_K,
    QType.Q3_K: LlamaFileType.MOSTLY_Q3_K_M, QType.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
    QType.Q5_K: LlamaFileType.MOSTLY_Q5_K_M, QType.Q6_K: LlamaFileType.MOSTLY_Q6_K,
    QType.IQ4_NL: LlamaFileType.MOSTLY_IQ4_NL, QType.IQ4_XS: LlamaFileType.MOSTLY_IQ4_XS,
    QType.MXFP4: LlamaFileType.MOSTLY_MXFP4_MOE,
}  # fmt: skip


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]  # torch order
    qtype: QType
    make: Callable[[], np.ndarray | torch.Tensor]  # raw bytes uint8 [..., row_bytes], made on demand

    @property
    def row_bytes(self) -> int:
        block_size, type_size = GGML_QUANT_SIZES[self.qtype]
        if self.shape[-1] % block_size:
            raise ValueError(f"tensor '{self.name}': a row of {self.shape[-1]} is not whole {self.qtype.name} blocks")
        return self.shape[-1] // block_size * type_size

    @property
    def num_bytes(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64)) * self.row_bytes


def tensor_from_float(name: str, x: torch.Tensor, qtype: QType = QType.F32) -> TensorSpec:
    """A tensor quantized from float values (small models written by tests)."""
    x = x.detach().float().cpu()
    return TensorSpec(name, tuple(x.shape), qtype, lambda: quantize(x, qtype))


def _value_type(value: Any) -> GGUFValueType:
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.INT32 if value < 0 else GGUFValueType.UINT32 if value < 2**32 else GGUFValueType.UINT64
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    raise TypeError(f"cannot store {type(value).__name__} in GGUF metadata")


def _add_metadata(writer: GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, (list, tuple)):
        if not value:
            writer.add_key_value(key, [], GGUFValueType.ARRAY, GGUFValueType.UINT32)
            return
        sub = GGUFValueType.INT32 if all(isinstance(v, int) and not isinstance(v, bool) for v in value) \
            else _value_type(value[0])
        writer.add_key_value(key, list(value), GGUFValueType.ARRAY, sub)
    else:
        writer.add_key_value(key, value, _value_type(value))


def file_type(specs: Iterable[TensorSpec]) -> LlamaFileType:
    """The file type of the tensor type that holds the most bytes (llama.cpp reports a file by it)."""
    num_bytes: dict[QType, int] = {}
    for spec in specs:
        num_bytes[spec.qtype] = num_bytes.get(spec.qtype, 0) + spec.num_bytes
    return FILE_TYPES.get(max(num_bytes, key=lambda t: num_bytes[t]), LlamaFileType.GUESSED)


def _raw_numpy(data: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(data, torch.Tensor):
        data = data.contiguous().cpu().numpy()
    return np.ascontiguousarray(data).view(np.uint8)


def _leave_hole(writer: GGUFWriter, specs: list[TensorSpec]) -> None:
    assert writer.fout is not None, "the writer's file is open"
    fout = writer.fout[0]
    pad = lambda n: -(-n // writer.data_alignment) * writer.data_alignment  # noqa: E731
    end = pad(fout.tell())
    for spec in specs:
        end = pad(end + spec.num_bytes)
    fout.truncate(end)
    writer.close()


def write_gguf(
    path: str | Path,
    arch: str,
    metadata: Mapping[str, Any],
    tensors: Iterable[TensorSpec],
    *,
    split_max_bytes: int = 0,
    progress: Callable[[int, int], None] | None = None,
    sparse: bool = False,
) -> list[Path]:
    """Write a model; with `split_max_bytes` it is split into `-0000i-of-0000N.gguf` files. `sparse`
    writes only the header and leaves the tensor data a hole of zeros (shapes for planning, not weights).
    `general.file_type` is added from the tensors' types unless the metadata has it."""
    path = Path(path)
    specs = list(tensors)
    if sparse and split_max_bytes:
        raise ValueError("a sparse model cannot be split")
    writer = GGUFWriter(path, arch, split_max_size=split_max_bytes)
    if specs and FILE_TYPE_KEY not in metadata:
        _add_metadata(writer, FILE_TYPE_KEY, int(file_type(specs)))
    for key, value in metadata.items():
        if key != "general.architecture":
            _add_metadata(writer, key, value)
    for spec in specs:
        byte_shape = (*spec.shape[:-1], spec.row_bytes)
        writer.add_tensor_info(spec.name, byte_shape, np.dtype(np.uint8), spec.num_bytes, raw_dtype=spec.qtype)
    paths = writer.format_shard_names(path)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    if sparse:
        _leave_hole(writer, specs)
        return [path]
    total = sum(s.num_bytes for s in specs)
    done = 0
    for spec in specs:
        data = _raw_numpy(spec.make())
        if data.nbytes != spec.num_bytes:
            raise ValueError(f"tensor '{spec.name}': made {data.nbytes} bytes, expected {spec.num_bytes}")
        writer.write_tensor_data(data)
        done += data.nbytes
        if progress:
            progress(done, total)
    writer.close()
    return [Path(p) for p in paths]


__all__ = ["GGMLQuantizationType", "TensorSpec", "tensor_from_float", "write_gguf"]
